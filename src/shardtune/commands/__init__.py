"""The commands of `shardtune <command>` (shardtune.cli's table): each reads its flags and calls the packages below it."""
