"""``python -m tierd`` is the ``tierd`` command."""

from tierd.cli import main

raise SystemExit(main())
