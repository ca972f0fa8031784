"""The compiled FA3 path on the CPU (FA3's documented semantics by tests/fa3_standin.py inside the compiled graph): a
graph per training plan, each built in the warmup. A file of its own beside tests/test_compiled.py, for a second test
worker."""

import os
import re

import pytest
import torch

import train_gpt as T
from conftest import stage_flags, tiny_args
import test_compiled
from test_compiled import REHEARSAL, measured_after_warmup, model_graphs

pytestmark = test_compiled.pytestmark
_fresh_dynamo_after = test_compiled._fresh_dynamo_after  # the fixture, here too


@pytest.mark.skipif(os.environ.get("SPEEDRUN_SLOW_COMPILES") != "1",
                    reason="opt-in (SPEEDRUN_SLOW_COMPILES=1): five minutes of cold compiles; the FA3 "
                           "graph counts are traced in test_gpu_path.py and the path runs eager in test_fa3_path.py")
def test_compiled_fa3_path_compiles_each_training_plan_in_the_warmup_only(tmp_path, monkeypatch):
    # FA3's arguments are Python numbers: a graph per plan, as in #89. Two stages of different lengths and short
    # windows under one long window (so one YaRN scale), the last validation at the first stage's windows: two
    # training graphs, both compiled in the warmup, and one validation graph. The stand-in (FA3's documented
    # semantics on the CPU) runs inside the compiled graph, as FA3's kernel does on a GPU.
    import fa3_standin
    monkeypatch.setattr(T, "load_fa3", lambda: (fa3_standin.flash_attn_varlen_func, ""))
    graphs_after_warmup, = measured_after_warmup(monkeypatch, model_graphs)
    torch._dynamo.reset()
    # The FP8 ops off (the rehearsal compiles them) and a narrower model: the graphs to count, at less compile time.
    args = dict(REHEARSAL, attention="fa3", fp8_head="false", fp8_mlp="false", model_dim=64, head_dim=32,
                **stage_flags((256, 192, "1/2", 1, "1/0.5", "1/0", 0.25, 0.25), (512, 2048, "0/2", 1.5, 1, 1, 0.25, 0),
                              (512, 2048, "0/2", 1.5, 1, 1, 0, 0)),
                final_val_windows="1/2", num_steps=4, val_every=0)
    result = T.run(tiny_args(tmp_path, run_id="fa3", **args))
    log = (tmp_path / "logs" / "fa3.txt").read_text()
    planned = int(re.search(r"^compile: graphs per function: model (\d+),", log, re.M).group(1))
    assert graphs_after_warmup == [2] and model_graphs() == planned == 3
    # cu_seqlens: the data's need at 256 tokens (where #89's rule, tokens // 300 rounded up to 128, gives 0), #89's
    # rule at 512 and validating
    assert re.search(r"^attention: fa3 .*256/192: 16 \(\d\), 512/2048: 128 \(\d\); validating 1024: 128", log, re.M)
    assert [s for s, _ in result.val_losses] == [0, 4] and result.val_losses[1][1] < result.val_losses[0][1]
