"""The sink loss (training.sink_loss): its probe measures exactly what eager attention shows, it leaves
the model's outputs as sdpa computes them, and optimising it really moves attention onto position 0."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from training import sink_loss


def _tiny() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").eval()


@pytest.fixture()
def batch() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(3, 64, (2, 40), generator=g)
    x[:, 0] = 1
    return x


def test_probe_matches_eager_attention_and_keeps_outputs(batch):
    model = _tiny()
    with torch.no_grad():
        model.set_attn_implementation("eager")
        ref = model(input_ids=batch, output_attentions=True)
        sink_loss.install(model)
        out = model(input_ids=batch)  # 39 query rows <= ROWS: every row is measured, no sampling
    assert torch.allclose(out.logits, ref.logits, atol=1e-5)
    for layer, attn in zip(model.model.layers, ref.attentions):
        assert torch.allclose(layer.self_attn.sink_mass, attn[:, :, 1:, 0].mean(-1), atol=1e-6)


def test_penalty_counts_layers_past_the_first_below_the_target():
    masses = [torch.tensor(0.0), torch.tensor(0.1), torch.tensor(0.5), torch.tensor(0.3)]
    # layer 0 is skipped; 0.5 is above the target; (0.4 - 0.1)^2 + (0.4 - 0.3)^2 = 0.1
    assert sink_loss.sink_penalty(masses, 0.4).item() == pytest.approx(0.10)
    assert sink_loss.sink_penalty(masses, 0.05).item() == 0.0


def test_training_on_the_penalty_raises_mass_on_position_0(batch):
    model = _tiny()
    sink_loss.install(model)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def masses() -> list[float]:
        with torch.no_grad():
            model(input_ids=batch)
        return [m.item() for m in sink_loss.layer_masses(model)]

    before = masses()
    for _ in range(30):
        model(input_ids=batch)
        sink_loss.sink_penalty(sink_loss.layer_masses(model), 0.6).backward()
        opt.step()
        opt.zero_grad()
    after = masses()
    assert all(a > b + 0.1 for a, b in zip(after[1:], before[1:])), (before, after)
