"""`shardtune train`'s recipe: its spine (recipe.train: start-up, build, loop, export) and its parts (the run's
configuration, settings, start-up checks, data, objective, checkpoints, outputs). Each takes the run's configuration and
the pieces built so far; none imports shardtune.commands, whose `train` reads the flags and maps errors to exit codes."""
