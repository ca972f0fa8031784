"""tools/rounding_effect.py: the --steps it accepts are the batches the bundled sample holds, and no others."""

import subprocess
import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "tools"))
import rounding_effect as RE  # noqa: E402

CFG = RE.recipe_config()
SEQ_LEN = RE.T.schedule(RE.T.stage_starts(CFG)[2], CFG).seq_len  # the shape the tool trains at
TOKENS = RE.sample_tokens(CFG)
MOST = RE.most_steps(CFG, TOKENS, SEQ_LEN)


def test_the_most_steps_are_whole_batches_and_one_more_is_not():
    assert {b.shape for b in RE.batches(CFG, TOKENS, MOST, SEQ_LEN)} == {(CFG.global_batch_seqs, SEQ_LEN + 1)}
    with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
        RE.batches(CFG, TOKENS, MOST + 1, SEQ_LEN)  # its last windows run past the sample's end


@pytest.mark.parametrize("steps", [-1, 0, MOST + 1])
def test_steps_outside_the_samples_batches_are_one_line_and_exit_2(steps):
    run = subprocess.run([sys.executable, str(REPO / "tools" / "rounding_effect.py"), "--steps", str(steps)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and run.stdout == "", run.stderr
    assert run.stderr.splitlines() == [f"error: --steps must be in [1, {MOST}] (the bundled sample's batches at this "
                                       f"shape), got {steps}"]
