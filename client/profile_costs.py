"""Measure the step cost (draft pass by rows, verify by tokens) of a model pair; write the file.

The command-line face of `avspec.tools.bench.profile_costs` (see there for what is timed, and
`--help` for the options). The launcher runs the same module at first start to measure the
cost tables of the host that serves (`avspec.serving.host.host_costs`).

Examples:
    python client/profile_costs.py --threads 1 --context 128 --output costs.json \\
        --plot bench/cost_tables.png
    python client/profile_costs.py --random-pair --device cuda --output costs_gpu.json
"""

from __future__ import annotations

import sys

from avspec.tools.bench.profile_costs import main

if __name__ == "__main__":
    sys.exit(main(command="python client/profile_costs.py"))
