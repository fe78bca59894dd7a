"""kernel_testlib.where_wrong: a failing prefill case's message names the sequences, rows,
key positions and KV heads that are off, so a first GPU run's failure points at its cause."""
from __future__ import annotations

import torch
from kernel_testlib import where_wrong


def test_the_message_locates_the_rows_off() -> None:
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(30, 8, 16, generator=gen)  # 3 sequences of 10 new tokens, 8 heads
    cu = torch.tensor([0, 10, 20, 30], dtype=torch.int32)
    seq_lens = torch.tensor([10, 140, 300], dtype=torch.int32)
    adapters = torch.tensor([0, -1, 2], dtype=torch.int32)
    out = ref.clone()
    out[13, 4:8] += 1.0  # seq 1, token 3: key position 133, KV head 1 of group 4
    out[26, 0, 0] = float("nan")  # seq 2, token 6: position 296, KV head 0
    lines = where_wrong(out, ref, cu, seq_lens, adapters, group=4).splitlines()
    assert lines[0].startswith("rel err inf; rows off: 5 of 240 (1 not finite)")
    worst = max(4.0 / ref[13, h].double().norm() for h in range(4, 8))  # |1 x 16| = 4
    assert lines[1] == ("seq 1 (adapter -1, 10 new of 140): 4 rows off, worst "
                        f"{float(worst):.3g}; "
                        "first at token 3 (key position 133: 5 in its 64-key tile, 5 in its "
                        "128), KV heads [1]")
    assert lines[2].startswith("seq 2 (adapter 2, 10 new of 300): 1 rows off")
    assert lines[2].endswith("first at token 6 (key position 296: 40 in its 64-key tile, "
                             "40 in its 128), KV heads [0]")
    assert where_wrong(ref, ref, cu, seq_lens, adapters, 4) == \
        "rel err 0; rows off: 0 of 240 (0 not finite)"
