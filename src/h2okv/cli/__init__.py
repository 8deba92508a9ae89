"""The ``h2okv`` command line: ``main`` parses, one module per subcommand registers itself."""

from h2okv.cli.main import main

__all__ = ["main"]
