"""The parts of `shardtune train`'s recipe (shardtune.train): start-up checks, data, objective, checkpoints,
outputs. Each takes the run's configuration and the pieces built so far; none imports shardtune.train."""
