"""The commands of `shardtune <command>` (the table in shardtune.cli): each reads its flags and calls the packages
below it."""
