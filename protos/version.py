"""This release's version, with no heavy import (the command line is built before grpc may be imported)."""

from __future__ import annotations

import importlib.metadata

SOFTWARE_VERSION = importlib.metadata.version("veriroll")
"""This release (pyproject's version, read from the installed package): what a node reports in Register,
and the oldest node release a coordinator accepts unless its operator says otherwise."""
UPGRADE_COMMAND = "pip install -U veriroll"
