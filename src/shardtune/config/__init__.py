"""A run's configuration: the flags, the accelerate and FSDP files, their checks, and what is derived from them once
(precision, dtypes, the CUDA allocator); nothing here loads a model or starts a process group."""
