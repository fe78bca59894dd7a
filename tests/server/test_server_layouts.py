"""The disaggregated and adaptive layouts (base pages shared, per-adapter residual pages; the
adaptive one keeps light load merged) behind the server: adapters by name, a branch step,
both pools accounted for, and /metrics shows both."""
from __future__ import annotations

import openai
import pytest
from server_testlib import start

from forkserve.config import KVLayout
from forkserve.interfaces.client import BranchClient


@pytest.mark.parametrize("layout", [KVLayout.DISAGGREGATED, KVLayout.ADAPTIVE])
def test_residual_pool_layouts_serve_adapters_without_leaks(tiny_model_dir, layout):
    with start(tiny_model_dir, kv_layout=layout) as server:
        oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        outs = {m: oai.chat.completions.create(model=m, max_tokens=6, temperature=0,
                                               messages=[{"role": "user",
                                                          "content": "Plan the fix."}])
                .choices[0].message.content for m in ("planner", "critic")}
        assert outs["planner"] != outs["critic"]
        with BranchClient(server.url) as client:
            s = client.open("critic", text="Review: the patch")
            node = client.fork(s.session_id, s.tip, text=" looks right")
            client.speculate(s.session_id, node, priority=1.0)
            assert client.commit(s.session_id, s.tip, text=" looks right to me").bound_node == node
            client.generate(s.session_id, 4)
            client.close(s.session_id)
            text = client.metrics()
        for name in ('forkserve_pages_used{pool="residual"}',
                     'forkserve_prefix_index_pages{tree="residual"}',
                     'forkserve_prefix_hit_ratio{tree="residual"}'):
            assert name in text, name

        def audit(e):
            e.check_integrity()
            held = (e.pool.num_used - e.index.num_pages,
                    e.residual_pool.num_used - e.residual_index.num_pages)
            e.evict_all()
            return len(e.sessions), held, e.pool.num_used, e.residual_pool.num_used
        assert server.on_engine(audit) == (0, (0, 0), 0, 0)
