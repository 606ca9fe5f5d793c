"""The parts of `shardtune train`'s recipe (shardtune.commands.train): start-up checks, data, objective, checkpoints,
outputs. Each takes the run's configuration and the pieces built so far; none imports shardtune.commands.train."""
