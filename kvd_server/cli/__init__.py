"""The `kvd` command: its parser and subcommands, what it prints, its errors and exit codes, and its channel to a running daemon."""
