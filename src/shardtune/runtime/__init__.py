"""The process around the work: logging, signals, child processes, atomic files, test hooks, the hub, the CPU."""
