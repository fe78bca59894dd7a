"""Round 28's loader probe (temporary): the ws prefill at 8 x 64 over 8K with its consumers
idle (odd PROBE) and/or its loader without table loads (2, 3) or with them a tile ahead
(4, 5); device time by graph replay; PROBE 4's output against 0's."""
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.kernelbench.setup import Setup  # noqa: E402
from benchmarks.kernelbench.timing import bench  # noqa: E402
from forkserve.kernels.residual_prefill_gluon import residual_prefill_ws  # noqa: E402

out = Path(os.environ.get("OUT", "/tmp")) / "ws_probe_round28.json"
s = Setup(smoke=False)
res = {"commit": os.environ.get("FORKSERVE_COMMIT", ""), "runs": []}
for batch, new, keys in ((8, 64, 8256), (4, 64, 32832)):
    bt, rbt, lens = s.tables(batch, keys)
    q = s.q(batch * new)
    cu = torch.arange(0, batch * new + 1, new, dtype=torch.int32, device=s.device)
    ad = s.adapters(batch)
    for adapters, label in ((ad, "adapter"), (torch.full_like(ad, -1), "no_adapter")):
        outs = {}
        for probe in (0, 1, 2, 3, 4, 5):
            os.environ["FORKSERVE_WS_PROBE"] = str(probe)

            def call():
                return residual_prefill_ws(q, s.k, s.v, s.k_res, s.v_res, bt, rbt, lens, cu,
                                           s.b_k, s.b_v, adapters, s.inv_freq,
                                           max_q_len=new, max_seq_len=keys)

            outs[probe] = call().float()
            torch.cuda.synchronize()
            ms = bench(call, False)
            row = {"case": f"{batch}x{new}/{keys}", "adapters": label, "probe": probe, "ms": ms}
            if probe == 4:
                row["max_abs_diff_vs_0"] = float((outs[4] - outs[0]).abs().max())
            res["runs"].append(row)
            print(row, flush=True)
            out.write_text(json.dumps(res, indent=1))
