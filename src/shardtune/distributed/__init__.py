"""Everything that touches torch.distributed: process group, device mesh, FSDP2 sharding, loading, gathering."""
