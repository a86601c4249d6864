"""A `command:` job's ranks: the team's own script run once per rank, and what Trident reads
of it (`docs/command.md`)."""
