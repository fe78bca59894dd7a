"""Prefix-cache isolation as a property of the keys: whatever sessions of whatever trust
boundaries (tenant, salt) open, generate and close, in any layout, with pages evicted and
parked on the host tier, no session ever attaches a page published under another boundary —
on the base tree, the residual tree or the host tier. (The engine on MockBackend: fast.)"""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from forkserve import Engine, ForkServeConfig, KVLayout
from forkserve.backend.mock import MockBackend
from forkserve.control.prefix_index import UNSALTED, CacheSalt

SALTS = [UNSALTED, CacheSalt("alice"), CacheSalt("bob"), CacheSalt("alice", "user-1"),
         CacheSalt("bob", "user-1"), CacheSalt.public("sys")]
TRUNK = list(range(10, 30))  # 5 pages shared by every prompt's tokens
PROMPTS = [TRUNK + [40, 41, 42], TRUNK + list(range(50, 62)), TRUNK[:12] + [70, 71], TRUNK]
# A residual pool small enough that turns evict residual pages to the host tier and back.
CONFIGS = [ForkServeConfig(page_size=4, num_pages=96, num_residual_pages=16, host_residual_pages=8,
                           vocab_size=300, kv_layout=layout, node_ttl_s=None)
           for layout in (KVLayout.UNIFIED, KVLayout.DISAGGREGATED, KVLayout.FULL_REUSE)]

turns = st.lists(st.tuples(st.sampled_from(range(len(SALTS))), st.sampled_from(range(len(PROMPTS))),
                           st.sampled_from([None, "planner", "critic"])), min_size=1, max_size=12)


def _attached_from_elsewhere(eng: Engine, sid: int, salt: CacheSalt) -> list[tuple[str, int]]:
    """Pages a just-opened session aliased that were published under another salt. Right
    after ``open`` nothing is computed yet: every page its root holds came from the index."""
    root = eng.sessions[sid].tree.root
    p = eng.pool.page_size
    bad = []
    sides = [("base", root.table.base, eng.index)]
    if root.table.residual is not None:
        sides.append(("residual", root.table.residual, eng.residual_index))
    for side, table, index in sides:
        salt_of = {e.page: e.salt for e in index.entries()}
        bad += [(side, page) for page in table.pages[:table.length // p] if salt_of[page] != salt]
    return bad


@settings(max_examples=40, deadline=None)
@given(config=st.sampled_from(CONFIGS), script=turns)
def test_no_page_is_ever_matched_across_trust_boundaries(config, script):
    eng = Engine(MockBackend(config))
    for salt_i, prompt_i, adapter in script:
        salt = SALTS[salt_i]
        sid = eng.open(PROMPTS[prompt_i], adapter=adapter, salt=salt).id
        assert _attached_from_elsewhere(eng, sid, salt) == []
        node = eng.fork(sid, eng.tip(sid), "guess", [90, 91, 92, 93, 94])  # forks keep the salt
        eng.drain_slack()
        eng.commit(sid, eng.tip(sid), [90, 91, 92, 93, 94, 95])
        assert eng.node(sid, eng.tip(sid)).table.salt == salt and node
        eng.generate(sid, 2)
        eng.close(sid)
        eng.check_integrity()
    for index in (eng.index, eng.residual_index):
        if index is not None:
            assert ({e.salt for e in index.entries()}
                    | {e.salt for e in index.offloaded_entries()}
                    ) <= {SALTS[i] for i, _, _ in script}


def test_within_one_boundary_pages_are_shared_and_across_none_are():
    config = CONFIGS[1]
    eng = Engine(MockBackend(config))
    alice, bob = CacheSalt("alice"), CacheSalt("bob")

    def hit(salt: CacheSalt) -> int:
        sid = eng.open(PROMPTS[1], adapter="planner", salt=salt).id
        attached = eng.node(sid, eng.tip(sid)).kv_len
        eng.generate(sid, 1)
        eng.close(sid)
        return attached

    assert hit(alice) == 0
    assert hit(alice) == 28   # every full page before the last token, both sides
    assert hit(bob) == 0      # the same tokens, another tenant: a miss
    assert hit(CacheSalt("alice", "u")) == 0


def test_routing_hashes_of_salted_pages_match_only_prompts_of_the_same_salt():
    """The Ray Serve router scores a new tree by the chained page hashes replicas publish: a
    salted page's hash is chained from its salt, so another boundary's prompt never matches
    it (which replica a request lands on reveals nothing of other tenants' prompts)."""
    from forkserve.interfaces.ray_serve.stats import (
        BASE_SCOPE,
        index_hashes,
        matched_pages,
        page_hashes,
    )

    eng = Engine(MockBackend(CONFIGS[1]))
    alice = CacheSalt("alice")
    sid = eng.open(PROMPTS[1], salt=alice).id
    eng.generate(sid, 1)
    eng.close(sid)
    published = index_hashes(eng.published_pages(), eng.config.page_size, {})
    full = len(PROMPTS[1]) // 4
    assert matched_pages(page_hashes(BASE_SCOPE, PROMPTS[1], 4, alice), published) == full
    for other in (UNSALTED, CacheSalt("bob"), CacheSalt("alice", "u"), CacheSalt.public("alice")):
        assert matched_pages(page_hashes(BASE_SCOPE, PROMPTS[1], 4, other), published) == 0
