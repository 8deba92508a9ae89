"""``python -m h2okv.cli`` (what torchrun starts on each rank): the ``h2okv`` command."""

import sys

from h2okv.cli.main import main

sys.exit(main())
