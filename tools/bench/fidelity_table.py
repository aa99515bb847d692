"""Print the table of docs/simulator.md, "Fidelity against published figures": each peer's published decode
tok/s beside the simulator's estimate of the same run from first principles (ggmoe/simulate/fidelity.py).

    python tools/bench/fidelity_table.py          # the markdown table (tests/unit/test_fidelity.py checks the doc)
"""

from __future__ import annotations

from ggmoe.simulate.fidelity import render_table

if __name__ == "__main__":
    print(render_table())
