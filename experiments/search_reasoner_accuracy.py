"""The paper's experiment on the Countdown search reasoner: experiments/tiny_reasoner_accuracy.py
with `--task countdown --ablations --plots` and this task's budgets.

Configurations (1000 test problems x 8 samples, top-p 0.95, paired keys): BF16 T = 0.6, NVFP4
W4A4 T = 0.6 (the ModelOpt recipe: static input scales calibrated on the reference traces of 32
validation problems), NVFP4 + ReSET (tau_0 = 80th percentile on 5 validation problems, T_low
from {0.1, 0.3, 0.5} on 200 validation problems, T_high 1.0, w 32), and the ablations T_high
0.6, 0.8 and include_current=True. Writes experiments/results/countdown_accuracy.{json,md},
calibrate_countdown.*, countdown_accuracy_offargmax.png, countdown_accuracy_step_entropy.png,
and MODEL/reset.json (the calibrated tau_0 and chosen T_low).

On the H200 (after experiments/train_search_reasoner.py):
    PYTHONPATH=. python experiments/search_reasoner_accuracy.py --model rejax/data/countdown
Any option of tiny_reasoner_accuracy.py may follow and overrides these defaults, e.g. a quick
look with `--n-problems 64 --n-samples 2 --n-val-problems 16 --out-prefix /tmp/cd`.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_reasoner_accuracy  # the experiment itself; this file only sets its options


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    model = None
    for i, a in enumerate(argv):
        if a == "--model" and i + 1 < len(argv):
            model = argv[i + 1]
        elif a.startswith("--model="):
            model = a.split("=", 1)[1]
    if model is None or model == "tiny":
        raise SystemExit("--model: give the trained Countdown checkpoint directory")
    defaults = ["--task", "countdown", "--ablations", "--plots", "--max-new-tokens", "512"]
    defaults += ["--input-scales", "calibrated"]  # the ModelOpt recipe: static input scales
    if "--reset-json" not in argv:
        defaults += ["--reset-json", str(Path(model) / "reset.json")]
    return tiny_reasoner_accuracy.main(defaults + argv)


if __name__ == "__main__":
    sys.exit(main())
