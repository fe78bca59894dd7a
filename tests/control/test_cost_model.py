"""The MockBackend's cost model: split rows priced apart only where it says so."""
import pytest

from forkserve.backend.cost_model import CostModel


def test_defaults_price_the_split_form_as_merged():
    model = CostModel()
    assert model.decode_ms(100, 50, 40) == pytest.approx(model.decode_ms(150))
    assert model.prefill_ms(1, 100, 100) == pytest.approx(model.prefill_ms(1, 100))


def test_split_rows_read_their_residual_and_the_shared_base_once():
    model = CostModel(decode_step_ms=1.0, decode_kv_token_ms=0.01, residual_token_ms=0.001,
                      prefill_token_ms=0.1, prefill_call_ms=0.0, split_prefill_factor=1.5)
    # 2 merged rows of 100 tokens, 4 split rows of 100 over one 96-token base.
    assert model.decode_ms(200, 400, 96) == pytest.approx(1.0 + 0.01 * 296 + 0.001 * 400)
    assert model.prefill_ms(1, 100, 40) == pytest.approx(0.1 * (60 + 40 * 1.5))
