"""One module per ``h2okv`` subcommand, plus shared argument helpers (``common``)."""
