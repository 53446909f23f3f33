"""``python -m mega_pretrain`` (what torchrun launches): the ``mega-pretrain`` command."""

import sys

from mega_pretrain.cli import main

sys.exit(main())
