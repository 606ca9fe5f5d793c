"""Everything about how the ranks divide the work, and the only package that imports torch.distributed.

The facts (`dims`: the sharding strategies and `ParallelDims`; `split`: the zigzag split of a batch's rows over the
context-parallel ranks and its layouts) import no torch.distributed, so configuration code can read them. The rest
runs the axes: the process group and device mesh (`mesh`), FSDP2 sharding (`fsdp`), building and loading the sharded
model (`setup`, `loading`), gathering (`gather`), checkpoints (`checkpoint`), the fake process group (`fake`) and the
context-parallel collectives (`context_parallel`). A new parallel axis lands here: its size in `dims`, its mesh
dimension in `mesh`, its split of the work, its sharding in `fsdp`.

Nothing is imported here: importing `shardtune.parallel.dims` must stay cheap.
"""
