"""Tests of policyopt.sampling against full forward passes, HuggingFace and hand-worked cases.

The references never go through the KV cache: they run each whole sequence (prompt
immediately followed by its continuation, right-padded) through the model in one forward
pass, step by step for greedy decoding, or call transformers' own `generate`.

Compiling a sampler takes seconds, so the tests share a few (batch, prompt length,
config) buckets through module-scoped fixtures.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from policyopt import sampling
from policyopt.models import ModelConfig, Transformer
from tests.settings import TINY_MODEL, TINY_MOE

VOCAB = 64
MAX_NEW = 8
# Larger weights than the default initialiser: peaked logits keep greedy decoding away
# from near-ties, so float32 summation order cannot flip an argmax.
_BASE = {**TINY_MODEL, "vocab_size": VOCAB, "initializer_range": 0.3}
MOE = ModelConfig(**_BASE, **TINY_MOE)
DENSE = ModelConfig(**_BASE)

# Right-padded prompts of three lengths. The padding value 0 is a real token id: padding
# must be ignored because of the mask, not because of its value.
PROMPTS = np.array(
    [[5, 17, 3, 9, 22, 41, 0], [7, 2, 0, 0, 0, 0, 0], [11, 30, 8, 60, 0, 0, 0]], np.int32
)
LENGTHS = np.array([6, 2, 4], np.int32)


def _forward_impl(graphdef, state, tokens, attention_mask, positions, routing):
    model = nnx.merge(graphdef, state)
    out = model(tokens, positions=positions, attention_mask=attention_mask, routing=routing)
    return out.logits.astype(jnp.float32), out.routing


_forward = jax.jit(_forward_impl, static_argnums=0)


def forward(model, tokens, attention_mask, positions=None, routing=None):
    """Full forward pass (no cache): float32 logits [B, T, V] and routing."""
    tokens = jnp.asarray(tokens, jnp.int32)
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    graphdef, state = nnx.split(model)
    return _forward(
        graphdef,
        state,
        tokens,
        jnp.asarray(attention_mask, jnp.int32),
        jnp.asarray(positions, jnp.int32),
        routing,
    )


def contiguous(responses, response_lengths, group=1):
    """Rows prompt[:len] + response[:response_len], right-padded to P + N, and their mask."""
    prompts, lengths = np.repeat(PROMPTS, group, axis=0), np.repeat(LENGTHS, group)
    responses, response_lengths = np.asarray(responses), np.asarray(response_lengths)
    rows, width = prompts.shape[0], prompts.shape[1] + responses.shape[1]
    tokens, mask = np.zeros((rows, width), np.int32), np.zeros((rows, width), np.int32)
    for r in range(rows):
        row = list(prompts[r, : lengths[r]]) + list(responses[r, : response_lengths[r]])
        tokens[r, : len(row)], mask[r, : len(row)] = row, 1
    return tokens, mask, lengths


def log_softmax(x):
    """float64 NumPy log softmax over the last axis."""
    x = np.asarray(x, np.float64)
    top = x.max(-1, keepdims=True)
    return x - top - np.log(np.exp(x - top).sum(-1, keepdims=True))


def reference_log_probs(model, rollout, temperature=1.0, group=1):
    """log softmax(logits / T) [R, N] of the generated tokens, from one full forward pass."""
    tokens, mask, lengths = contiguous(rollout.tokens, rollout.lengths, group)
    logits, _ = forward(model, tokens, mask)
    log_probs = log_softmax(np.asarray(logits) / temperature)
    ref = np.zeros(rollout.tokens.shape, np.float32)
    for r in range(tokens.shape[0]):
        for t in range(int(rollout.lengths[r])):
            ref[r, t] = log_probs[r, lengths[r] - 1 + t, tokens[r, lengths[r] + t]]
    return ref


def greedy_reference(model, steps):
    """Step-by-step argmax of the full forward pass over the growing sequences."""
    rows = PROMPTS.shape[0]
    out = np.zeros((rows, steps), np.int32)
    tokens, mask, lengths = contiguous(out, np.zeros(rows, np.int32))
    for t in range(steps):
        logits = np.asarray(forward(model, tokens, mask)[0])
        for r in range(rows):
            out[r, t] = np.argmax(logits[r, lengths[r] - 1 + t])
            tokens[r, lengths[r] + t], mask[r, lengths[r] + t] = out[r, t], 1
    return out


def run(model, prompts=PROMPTS, lengths=LENGTHS, seed=0, **kwargs):
    kwargs.setdefault("max_new_tokens", MAX_NEW)
    return sampling.generate(model, prompts, lengths, rng=jax.random.key(seed), **kwargs)


def response_log_probs(logits, rollout, prompt_len):
    """Log-probs of the response tokens from logits over `Rollout.sequences()`."""
    log_probs = log_softmax(np.asarray(logits)[:, prompt_len - 1 : -1])
    tokens = np.asarray(rollout.tokens)[..., None]
    return np.take_along_axis(log_probs, tokens, axis=-1)[..., 0] * np.asarray(rollout.mask)


@pytest.fixture(scope="module")
def moe_model():
    return Transformer(MOE, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def moe_greedy(moe_model):
    return run(moe_model, temperature=0.0)


@pytest.fixture(scope="module")
def moe_sampled(moe_model):
    return run(moe_model, temperature=1.0, seed=3)


# ------------------------------------------------------------------ sampling methods


def test_top_k_top_p_temperature_hand_worked():
    # Probabilities 0.5, 0.3, 0.15, 0.05 in each of 4000 rows.
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = jnp.asarray(np.broadcast_to(np.log(probs), (4000, 4)), jnp.float32)
    rng = jax.random.key(0)

    def draw(method):
        tokens, log_probs = jax.jit(method.sample)(logits, rng)
        return np.asarray(tokens), np.asarray(log_probs)

    # top-p 0.7: mass before each candidate is 0, .5, .8, .95 -> keep {0, 1}: .625, .375.
    tokens, log_probs = draw(sampling.TopP(p=0.7))
    assert set(np.unique(tokens)) == {0, 1}
    np.testing.assert_allclose(log_probs, np.log(np.where(tokens == 0, 0.625, 0.375)), rtol=1e-5)
    assert abs((tokens == 0).mean() - 0.625) < 4 * np.sqrt(0.625 * 0.375 / 4000)
    # top-k 3 at temperature 2: softmax(log p / 2) over the first three = sqrt(p) renormalised.
    tokens, log_probs = draw(sampling.TopK(k=3, temperature=2.0))
    kept = np.sqrt(probs[:3]) / np.sqrt(probs[:3]).sum()
    assert set(np.unique(tokens)) == {0, 1, 2}
    np.testing.assert_allclose(log_probs, np.log(kept[tokens]), rtol=1e-5)
    # top-k 2 renormalises to .625 / .375, then top-p 0.6 keeps token 0 only.
    tokens, log_probs = draw(sampling.TopP(p=0.6, top_k=2))
    assert np.all(tokens == 0) and np.allclose(log_probs, 0.0)
    # Temperature 0.5: p^2 renormalised, every token reachable.
    tokens, log_probs = draw(sampling.Temperature(0.5))
    expected = np.log(probs**2 / (probs**2).sum())
    assert set(np.unique(tokens)) == {0, 1, 2, 3}
    np.testing.assert_allclose(log_probs, expected[tokens], rtol=1e-5)


def test_top_k_beyond_the_vocabulary_is_plain_temperature_sampling():
    logits = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    key = jax.random.key(3)
    tokens, log_probs = jax.jit(sampling.TopK(k=100, temperature=0.5).sample)(logits, key)
    expected = log_softmax(logits / 0.5)
    np.testing.assert_allclose(
        np.asarray(log_probs),
        np.take_along_axis(expected, np.asarray(tokens)[:, None], 1)[:, 0],
        rtol=1e-5,
    )


def test_top_k_1_is_greedy():
    logits = np.random.default_rng(0).standard_normal((64, 512)).astype(np.float32) * 3.0
    tokens, log_probs = jax.jit(sampling.TopK(k=1, temperature=0.7).sample)(
        logits, jax.random.key(1)
    )
    greedy_tokens, greedy_log_probs = jax.jit(sampling.Greedy().sample)(logits, None)
    np.testing.assert_array_equal(np.asarray(tokens), np.argmax(logits, -1))
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(greedy_tokens))
    np.testing.assert_array_equal(np.asarray(log_probs), 0.0)
    np.testing.assert_array_equal(np.asarray(greedy_log_probs), 0.0)


def test_sampling_method_choice_and_errors():
    assert sampling.sampling_method(0.0, top_k=5, top_p=0.5) == sampling.Greedy()
    assert sampling.sampling_method(0.7) == sampling.Temperature(0.7)
    assert sampling.sampling_method(1.0, top_k=4) == sampling.TopK(4, 1.0)
    assert sampling.sampling_method(1.0, top_k=4, top_p=0.9) == sampling.TopP(0.9, 1.0, 4)
    with pytest.raises(ValueError, match="top_p"):
        sampling.sampling_method(1.0, top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        sampling.TopK(k=2, temperature=0.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        sampling.SamplingConfig(max_new_tokens=0)
    with pytest.raises(ValueError, match="prompt_lengths"):
        sampling.generate(
            None, PROMPTS, np.array([0, 1, 2]), max_new_tokens=2, rng=jax.random.key(0)
        )


# ------------------------------------------------------------------ against full forwards


def test_greedy_equals_stepwise_argmax(moe_model, moe_greedy):
    np.testing.assert_array_equal(
        np.asarray(moe_greedy.tokens), greedy_reference(moe_model, MAX_NEW)
    )
    np.testing.assert_array_equal(np.asarray(moe_greedy.mask), 1.0)
    np.testing.assert_array_equal(np.asarray(moe_greedy.log_probs), 0.0)  # a point mass
    # Greedy raw log-probs: the model's own distribution (temperature 1).
    np.testing.assert_allclose(
        np.asarray(moe_greedy.raw_log_probs), reference_log_probs(moe_model, moe_greedy), atol=2e-4
    )


@pytest.fixture(scope="module")
def dense_model():
    return Transformer(DENSE, rngs=nnx.Rngs(1))


@pytest.mark.parametrize("name", ["moe", "dense"])
def test_log_probs_equal_full_forward(name, moe_model, dense_model, moe_sampled):
    if name == "moe":
        model, rollout = moe_model, moe_sampled
    else:
        model, rollout = dense_model, run(dense_model, temperature=1.0, seed=3)
    assert (rollout.routing is None) == (name == "dense")
    ref = reference_log_probs(model, rollout)
    np.testing.assert_allclose(np.asarray(rollout.log_probs), ref, atol=2e-4)
    np.testing.assert_allclose(np.asarray(rollout.raw_log_probs), ref, atol=2e-4)
    assert np.all(np.asarray(rollout.lengths) == MAX_NEW)
    # The training layout of Rollout.sequences() (prompts right-aligned) gives the same.
    tokens, positions, attention_mask = rollout.sequences()
    logits, _ = forward(model, tokens, attention_mask, positions)
    np.testing.assert_allclose(
        response_log_probs(logits, rollout, PROMPTS.shape[1]), ref, atol=2e-4
    )


@pytest.mark.parametrize("decode_dispatch", ["ragged", "dense", "gathered"])
def test_decode_dispatch_gives_the_same_rollout(moe_model, moe_sampled, decode_dispatch):
    """Prefill "blocked", decode "ragged" (moe_decode_dispatch; the GPU layout of
    moe_0p5b), "dense" or "gathered" (the CPU presets' decode): the same weights sample the same
    tokens, routing and log-probs as the single-dispatch model, and the log-probs equal a
    full (blocked) forward pass."""
    mixed = Transformer(
        MOE.replace(moe_dispatch="blocked", moe_block_size=2, moe_decode_dispatch=decode_dispatch),
        rngs=nnx.Rngs(0),
    )
    rollout = run(mixed, temperature=1.0, seed=3)
    np.testing.assert_array_equal(np.asarray(rollout.tokens), np.asarray(moe_sampled.tokens))
    np.testing.assert_array_equal(np.asarray(rollout.routing), np.asarray(moe_sampled.routing))
    np.testing.assert_allclose(
        np.asarray(rollout.log_probs), np.asarray(moe_sampled.log_probs), atol=2e-5
    )
    np.testing.assert_allclose(
        np.asarray(rollout.log_probs), reference_log_probs(mixed, rollout), atol=2e-4
    )


def test_routing_replay_reproduces_log_probs(moe_model, moe_sampled):
    rollout, prompt_len = moe_sampled, PROMPTS.shape[1]
    tokens, positions, attention_mask = rollout.sequences()
    assert rollout.routing.shape == (MOE.num_layers, 3, prompt_len + MAX_NEW, 2)

    def replay(routing):
        logits, free_routing = forward(moe_model, tokens, attention_mask, positions, routing)
        return response_log_probs(logits, rollout, prompt_len), np.asarray(free_routing)

    replayed, _ = replay(rollout.routing)
    np.testing.assert_allclose(replayed, np.asarray(rollout.log_probs), atol=2e-4)
    # The recorded routing is the one a full forward chooses, at every real token.
    _, free_routing = replay(None)
    valid = np.asarray(attention_mask, bool)
    np.testing.assert_array_equal(free_routing[:, valid], np.asarray(rollout.routing)[:, valid])
    # Replay is really applied: other experts give other log-probs.
    changed, _ = replay((rollout.routing + 1) % MOE.num_experts)
    assert np.max(np.abs(changed - replayed)) > 1e-2


def test_greedy_equals_transformers_generate(tmp_path, moe_greedy):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from policyopt.models import from_pretrained

    hf_config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        norm_topk_prob=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        initializer_range=0.3,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=None,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    hf_model = transformers.Qwen3MoeForCausalLM(hf_config).eval()
    hf_model.save_pretrained(tmp_path)
    model = from_pretrained(str(tmp_path))
    assert model.config == MOE  # same sampler bucket as moe_greedy: no new compile

    rollout = run(model, temperature=0.0)
    assert np.any(np.asarray(rollout.tokens) != np.asarray(moe_greedy.tokens))  # new weights
    for r in range(PROMPTS.shape[0]):
        prompt = torch.tensor(PROMPTS[r : r + 1, : LENGTHS[r]], dtype=torch.long)
        with torch.no_grad():
            out = hf_model.generate(
                prompt,
                max_new_tokens=MAX_NEW,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
        continuation = out.sequences[0, LENGTHS[r] :]
        np.testing.assert_array_equal(np.asarray(rollout.tokens[r]), continuation.numpy())
        hf_log_probs = torch.log_softmax(torch.stack(out.logits)[:, 0].double(), dim=-1)
        hf_log_probs = hf_log_probs.gather(-1, continuation[:, None])[:, 0].numpy()
        np.testing.assert_allclose(np.asarray(rollout.raw_log_probs[r]), hf_log_probs, atol=2e-4)


# ------------------------------------------------------------------ behaviour


def test_padded_equals_unpadded(dense_model):
    # Three prompts of length 4, unpadded ([3, 4]) and padded to 7 columns with a token
    # that is not padding by value (the padded run shares the dense [3, 7] bucket).
    # Right-padded prompts of different lengths are also checked against unpadded full
    # forwards in the tests above.
    prompts = np.array([[3, 14, 15, 9], [2, 6, 53, 5], [1, 41, 42, 13]], np.int32)
    lengths = np.full(3, 4, np.int32)
    padded = np.concatenate([prompts, np.full((3, 3), 7, np.int32)], axis=1)
    a = run(dense_model, prompts, lengths, temperature=1.0, seed=11)
    b = run(dense_model, padded, lengths, temperature=1.0, seed=11)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    np.testing.assert_allclose(np.asarray(a.log_probs), np.asarray(b.log_probs), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(b.prompt_tokens)[:, 3:], prompts)
    np.testing.assert_array_equal(np.asarray(b.prompt_tokens)[:, :3], 0)  # pad_id


def test_eos_and_stop_sequence_end_and_mask(moe_model, moe_greedy):
    # Greedy decoding is deterministic, so where each row must end follows from the
    # continuation without EOS: at the first EOS or the first complete stop sequence.
    free = np.asarray(moe_greedy.tokens)
    eos = int(free[0, 2])
    stop = (int(free[1, 3]), int(free[1, 4]))
    lengths = []
    for row in free:
        ends = [t + 1 for t in range(MAX_NEW) if row[t] == eos]
        ends += [t + 1 for t in range(1, MAX_NEW) if (row[t - 1], row[t]) == stop]
        lengths.append(min(ends, default=MAX_NEW))
    lengths = np.array(lengths)
    assert lengths[0] <= 3 and lengths[1] <= 5
    valid = np.arange(MAX_NEW)[None] < lengths[:, None]

    rollout = run(moe_model, temperature=0.0, eos_id=eos, stop_sequences=(stop,))
    np.testing.assert_array_equal(np.asarray(rollout.lengths), lengths)
    np.testing.assert_array_equal(np.asarray(rollout.mask), valid)
    np.testing.assert_array_equal(np.asarray(rollout.tokens), np.where(valid, free, eos))
    np.testing.assert_array_equal(np.asarray(rollout.raw_log_probs)[~valid], 0.0)
    assert int(rollout.num_steps) == lengths.max()  # the loop stopped when all rows ended


def test_decode_segments_give_the_same_rollout(moe_model, moe_sampled):
    """Decoding in K = 3 loops over growing caches (ends at steps 2, 5, 8) samples the same
    tokens, log-probs and routing as one loop, with an EOS and a stop sequence that end rows
    in different loops, G = 2 samples per prompt and min_new_tokens (one compiled pair: the
    loops of a run without end tokens are these loops with nothing ending)."""
    config = sampling.SamplingConfig(max_new_tokens=MAX_NEW, decode_segments=3)
    assert config.segment_ends == (2, 5, 8)
    assert sampling.SamplingConfig(max_new_tokens=10, decode_segments=4).segment_ends == (
        2,
        5,
        7,
        10,
    )

    def same(one, three):
        for field in ("tokens", "mask", "routing", "lengths", "num_steps"):
            np.testing.assert_array_equal(
                np.asarray(getattr(three, field)), np.asarray(getattr(one, field)), err_msg=field
            )
        for field in ("log_probs", "raw_log_probs"):
            np.testing.assert_allclose(
                np.asarray(getattr(three, field)),
                np.asarray(getattr(one, field)),
                atol=1e-5,
                err_msg=field,
            )

    tokens = np.asarray(moe_sampled.tokens)
    ending = dict(
        eos_id=int(tokens[0, 1]),
        stop_sequences=((int(tokens[1, 3]), int(tokens[1, 4])),),
        num_samples=2,
        min_new_tokens=1,
        temperature=1.0,
        seed=3,
    )
    one, three = run(moe_model, **ending), run(moe_model, decode_segments=3, **ending)
    same(one, three)
    assert 1 < np.asarray(one.lengths).min() < MAX_NEW  # rows end inside the run


def test_decode_segments_validated():
    with pytest.raises(ValueError, match="decode_segments"):
        sampling.SamplingConfig(max_new_tokens=4, decode_segments=5)
    with pytest.raises(ValueError, match="decode_segments"):
        sampling.SamplingConfig(max_new_tokens=4, decode_segments=0)


def test_fixed_rng_reproducible(moe_model, moe_sampled):
    again = run(moe_model, temperature=1.0, seed=3)
    np.testing.assert_array_equal(np.asarray(again.tokens), np.asarray(moe_sampled.tokens))
    np.testing.assert_array_equal(np.asarray(again.log_probs), np.asarray(moe_sampled.log_probs))
    other = run(moe_model, temperature=1.0, seed=4)
    assert np.any(np.asarray(other.tokens) != np.asarray(moe_sampled.tokens))


def behaviour_reference(logits, method, banned=None):
    """float64 NumPy log-probs [V] of the distribution `method` samples from (-inf when
    excluded): temperature, the EOS ban, then top-k, then top-p."""
    scaled = np.asarray(logits, np.float64) / method.temperature
    if banned is not None:
        scaled[banned] = -np.inf
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    order = order[: method.top_k] if method.top_k else order
    top = probs[order] / probs[order].sum()
    kept = order[np.cumsum(top) - top < method.p]
    out = np.full(probs.shape, -np.inf)
    out[kept] = np.log(probs[kept] / probs[kept].sum())
    return out


def test_group_samples_top_k_top_p_eos_min_new_tokens(moe_model, moe_greedy):
    # G = 3 samples per prompt from one prefill, top-k then top-p at temperature 1.5;
    # EOS = the most likely first token of prompt 0, banned for the first 2 steps.
    group, min_new = 3, 2
    method = sampling.TopP(p=0.9, temperature=1.5, top_k=8)
    eos = int(moe_greedy.tokens[0, 0])
    rollout = run(
        moe_model, method=method, num_samples=group, eos_id=eos, min_new_tokens=min_new, seed=21
    )
    rows = 3 * group
    assert rollout.tokens.shape == (rows, MAX_NEW)
    np.testing.assert_array_equal(np.asarray(rollout.prompt_lengths), np.repeat(LENGTHS, group))
    tokens, lengths = np.asarray(rollout.tokens), np.asarray(rollout.lengths)
    assert all(
        len({tuple(row) for row in tokens[b * group : (b + 1) * group]}) > 1 for b in range(3)
    )  # samples of one prompt differ
    assert np.all(tokens[:, :min_new] != eos) and np.all(lengths >= min_new)
    assert np.any(lengths < MAX_NEW)  # some row did end at EOS
    for r in range(rows):  # rows end at their first EOS, and are padded after it
        hits = np.flatnonzero(tokens[r, : lengths[r]] == eos)
        assert (hits.size == 0 and lengths[r] == MAX_NEW) or list(hits) == [lengths[r] - 1]
        assert np.all(tokens[r, lengths[r] :] == eos)
    # Every row continues its own prompt (rows b*G .. b*G+G-1 <- prompt b): behaviour
    # log-probs are those of the truncated distribution, raw ones of softmax(logits / T).
    seq, mask, prompt_lengths = contiguous(tokens, lengths, group)
    logits = np.asarray(forward(moe_model, seq, mask)[0])
    behaviour, raw = np.zeros((rows, MAX_NEW)), np.zeros((rows, MAX_NEW))
    for r in range(rows):
        for t in range(lengths[r]):
            row_logits = logits[r, prompt_lengths[r] - 1 + t]
            token = tokens[r, t]
            banned = eos if t < min_new else None
            behaviour[r, t] = behaviour_reference(row_logits, method, banned)[token]
            scaled = row_logits.astype(np.float64) / method.temperature
            raw[r, t] = scaled[token] - scaled.max() - np.log(np.exp(scaled - scaled.max()).sum())
    np.testing.assert_allclose(np.asarray(rollout.log_probs), behaviour, atol=2e-4)
    np.testing.assert_allclose(np.asarray(rollout.raw_log_probs), raw, atol=2e-4)
    assert np.any(np.abs(behaviour - raw) > 1e-2)  # truncation mattered


def test_compiles_once_per_bucket(moe_model, moe_sampled):
    # New prompt values, a new rng and new parameters of the same structure: no retrace.
    graphdef, state = nnx.split(moe_model)
    config = sampling.SamplingConfig(max_new_tokens=MAX_NEW, method=sampling.Temperature(1.0))
    before = sampling.generate_fn._cache_size()
    new_state = jax.tree.map(lambda x: jnp.asarray(np.asarray(x) * np.float32(1.01)), state)
    for seed in (3, 4, 5):
        prompts = jnp.asarray((PROMPTS + seed - 3) % VOCAB)
        out = sampling.generate_fn(
            graphdef,
            state if seed == 3 else new_state,
            prompts,
            jnp.asarray(LENGTHS),
            jax.random.key(seed),
            config=config,
        )
        if seed == 3:
            np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(moe_sampled.tokens))
    assert sampling.generate_fn._cache_size() == before
    # generate_fn traces inside a caller's own jit (e.g. a trainer step).
    step = jax.jit(
        lambda s, rng: sampling.generate_fn(
            graphdef, s, jnp.asarray(PROMPTS), jnp.asarray(LENGTHS), rng, config=config
        ).log_probs.sum()
    )
    assert step.lower(state, jax.random.key(3)).out_info.shape == ()


def test_token_ids_outside_the_vocabulary_raise(dense_model):
    """pad_id / eos_id / stop ids must be in [0, V): a pad_id of 99 with V = 64 was written
    into rollouts; a negative eos_id banned token V - 1 under min_new_tokens."""
    for field, value in (
        ("pad_id", VOCAB),
        ("eos_id", 99),
        ("stop_ids", (3, VOCAB + 1)),
        ("stop_sequences", ((5, 70),)),
    ):
        with pytest.raises(
            ValueError,
            match=rf"SamplingConfig\.{field}.* = \d+ is outside "
            rf"the model's vocabulary \[0, {VOCAB}\)",
        ):
            run(dense_model, temperature=1.0, **{field: value})
    for field, value in (
        ("pad_id", -1),
        ("eos_id", -2),
        ("stop_ids", (-1,)),
        ("stop_sequences", ((4, -1),)),
    ):
        with pytest.raises(ValueError, match=rf"SamplingConfig\.{field}.* = -\d is a negative"):
            sampling.SamplingConfig(max_new_tokens=2, **{field: value})
    # generate_fn checks too (at trace time), with the model's vocabulary.
    graphdef, state = nnx.split(dense_model)
    with pytest.raises(ValueError, match=r"pad_id = 64 is outside"):
        sampling.generate_fn(
            graphdef,
            state,
            jnp.asarray(PROMPTS),
            jnp.asarray(LENGTHS),
            jax.random.key(0),
            config=sampling.SamplingConfig(max_new_tokens=2, pad_id=VOCAB),
        )
    # Real prompt tokens are checked; padding may hold anything.
    prompts = PROMPTS.copy()
    prompts[2, 1] = VOCAB
    with pytest.raises(ValueError, match=r"prompts\[2, 1\] = 64 is outside"):
        run(dense_model, prompts, temperature=1.0)
    prompts = PROMPTS.copy()
    prompts[1, 2:] = [VOCAB, -1, 10**6, VOCAB, VOCAB]
    padded = run(dense_model, prompts, temperature=1.0, seed=11)
    plain = run(dense_model, temperature=1.0, seed=11)
    np.testing.assert_array_equal(np.asarray(padded.tokens), np.asarray(plain.tokens))
    np.testing.assert_array_equal(np.asarray(padded.prompt_tokens), np.asarray(plain.prompt_tokens))
