"""How the ranks divide the work: the sharding strategies and the parallel dimensions.

Everything that means "the data-parallel size" or "this rank's data-parallel index" reads `ParallelDims`, not the
world size: the two differ with a context-parallel axis and a tensor-parallel one (whose ranks share a batch).
Nothing here imports torch.distributed; shardtune.parallel.mesh builds the device mesh from these numbers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Strategy:
    """An FSDP1 sharding strategy (the names accelerate's YAML uses) in FSDP2 terms."""

    name: str
    reshard_after_forward: bool  # whether a block's parameters are freed after forward (False: ZeRO-2)
    hybrid: bool  # shard within a machine, replicate across machines
    sharded: bool  # False for NO_SHARD: every rank holds everything (DDP)


# In accelerate's order: its YAML may give the strategy as the number 1..5.
STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in (
        Strategy("FULL_SHARD", True, False, True),
        Strategy("SHARD_GRAD_OP", False, False, True),
        Strategy("NO_SHARD", False, False, False),
        Strategy("HYBRID_SHARD", True, True, True),
        Strategy("HYBRID_SHARD_ZERO2", False, True, True),
    )
}
STRATEGY_BY_NUMBER = {str(i + 1): name for i, name in enumerate(STRATEGIES)}
# FSDP2's reshard_after_forward=False applied to a strategy that reshards: the ZeRO-2 variant of it.
ZERO2_OF = {"FULL_SHARD": "SHARD_GRAD_OP", "HYBRID_SHARD": "HYBRID_SHARD_ZERO2"}


def strategy(name: str) -> Strategy:
    if name not in STRATEGIES:
        raise ValueError(f"sharding strategy {name!r}: use one of {', '.join(STRATEGIES)}")
    return STRATEGIES[name]


@dataclass(frozen=True)
class ParallelDims:
    """The mesh's axes and this rank's place on them.

    Data parallelism has two axes: `dp_replicate` (full replicas: across machines with HYBRID_SHARD, every rank with
    NO_SHARD) and `dp_shard` (the FSDP shard group). Their product is the number of distinct batches per step.
    Context parallelism (`cp`) splits each of those batches' sequences over `cp` consecutive ranks
    (shardtune.parallel.split), which FSDP shards the parameters over too, as torchtitan does: the shard group
    is dp_shard × cp ranks, so adding cp also lowers the weights' memory per rank.
    Tensor parallelism (`tp`) is the innermost axis, as torchtitan orders its mesh (dp_replicate, dp_shard, cp,
    tp): ranks r·tp .. r·tp + tp - 1 share everything but their slices of the blocks' linear layers, so they see
    the same batch and sit on one machine; FSDP shards over the other axes only (shardtune.parallel.tensor).
    """

    dp_replicate: int
    dp_shard: int
    dp_replicate_rank: int = 0
    dp_shard_rank: int = 0
    cp: int = 1  # context parallel: the ranks one batch's sequences are split over
    tp: int = 1  # tensor parallel: the ranks the blocks' linear layers are sliced over
    replicate_axis: bool = False  # whether the mesh has a "replicate" dimension
    cp_rank: int = 0  # this rank's index among its batch's cp ranks: which part of each sequence it holds
    tp_rank: int = 0  # this rank's index among its tp ranks: which slice of each sliced layer it holds

    @property
    def dp_size(self) -> int:
        """How many different batches one step sees: the divisor of the global token count."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks: which batch of the step it takes."""
        return self.dp_replicate_rank * self.dp_shard + self.dp_shard_rank

    @property
    def world_size(self) -> int:
        return self.dp_size * self.cp * self.tp

    @property
    def gradient_divisor(self) -> int:
        """The ranks FSDP averages gradients over (every rank of the mesh): a loss normalised over the global batch
        is multiplied by this so that the average is the global batch's gradient."""
        return self.dp_size * self.cp

    @property
    def shard_size(self) -> int:
        """The ranks FSDP shards every parameter over (the mesh's shard dimension)."""
        return self.dp_shard * self.cp

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """2-D (replicate, shard) when there is a replicate axis; NO_SHARD keeps one even on one rank, since
        FSDP2 replicates along a mesh's first dimension. The shard dimension spans dp_shard × cp ranks."""
        dp = (self.dp_replicate, self.shard_size) if self.replicate_axis else (self.shard_size,)
        return (*dp, self.tp) if self.tp > 1 else dp

    @classmethod
    def build(
        cls, *, world_size: int, local_world_size: int, rank: int, sharding_strategy: str, cp: int = 1, tp: int = 1
    ) -> ParallelDims:
        """The axes of `world_size` ranks; with tp > 1 (dividing a machine's processes) the data- and
        context-parallel axes are laid out over the world_size / tp groups of tp consecutive ranks."""
        if tp > 1:
            if world_size % tp or local_world_size % tp:
                raise ValueError(
                    f"tensor parallel size {tp} must divide the world size and a machine's processes ({world_size} "
                    f"processes, {local_world_size} per machine): its ranks exchange activations in every layer."
                )
            rest = cls.build(
                world_size=world_size // tp, local_world_size=local_world_size // tp, rank=rank // tp,
                sharding_strategy=sharding_strategy, cp=cp,
            )  # fmt: skip
            return dataclasses.replace(rest, tp=tp, tp_rank=rank % tp)
        return cls._build_dp_cp(world_size, local_world_size, rank, sharding_strategy, cp)

    @classmethod
    def _build_dp_cp(
        cls, world_size: int, local_world_size: int, rank: int, sharding_strategy: str, cp: int
    ) -> ParallelDims:
        """NO_SHARD replicates on every rank; HYBRID shards within a machine and replicates across machines
        (on one machine it is FULL_SHARD); the others shard across all ranks. With cp > 1 (a sharded strategy,
        and a machine's processes divisible by cp under HYBRID), ranks r·cp .. r·cp + cp - 1 share data-parallel
        batch r: consecutive ranks, so a batch's cp ranks are on one machine and inside one shard group."""
        s = strategy(sharding_strategy)
        if cp > 1 and (not s.sharded or world_size % cp or (s.hybrid and local_world_size % cp)):
            raise ValueError(
                f"context parallel size {cp} needs a sharded strategy and a world size it divides, and under "
                f"HYBRID_SHARD a machine's processes it divides ({sharding_strategy}, {world_size} processes, "
                f"{local_world_size} per machine)."
            )
        replicate_axis = True
        if not s.sharded:
            replicate, shard = world_size, 1
        elif s.hybrid and world_size > local_world_size:
            if world_size % local_world_size:
                raise ValueError(
                    f"{sharding_strategy} needs the same number of processes on every node ({world_size} processes, "
                    f"{local_world_size} on this node)."
                )
            replicate, shard = world_size // local_world_size, local_world_size // cp
        else:
            replicate, shard, replicate_axis = 1, world_size // cp, False
        dp = rank // cp
        return cls(replicate, shard, dp // shard, dp % shard, cp=cp, replicate_axis=replicate_axis, cp_rank=rank % cp)

    @property
    def dp_mesh_dim_names(self) -> tuple[str, ...]:
        """The mesh dimensions FSDP shards and replicates over (all but tp)."""
        return ("replicate", "shard") if self.replicate_axis else ("shard",)

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        return (*self.dp_mesh_dim_names, "tp") if self.tp > 1 else self.dp_mesh_dim_names
