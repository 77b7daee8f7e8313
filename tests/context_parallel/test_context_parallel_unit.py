"""mpu_lab.core.context_parallel in one process: Megatron's layout against positions worked by hand,
the causal block pattern of the ring against a brute-force mask, the log-sum-exp merge and the
block backward against torch's SDPA and autograd, and the errors bad inputs raise.
The multi-rank attention itself: tests/context_parallel/test_context_parallel_mp.py."""
import pytest
import torch
import torch.nn.functional as F

from mpu_lab.core import context_parallel as cp
from mpu_lab.core import parallel_state as ps
from mpu_lab.core.context_parallel import block_attention, layout, ring_attention


@pytest.fixture
def cp_world(monkeypatch):
    """``set_cp(rank, size)``: the CP rank and size ``parallel_state`` reports (no real world)."""
    def set_cp(rank, size):
        monkeypatch.setattr(ps, "get_context_parallel_rank", lambda: rank)
        monkeypatch.setattr(ps, "get_context_parallel_world_size", lambda: size)
    return set_cp


def positions_batch(s=16, b=2):
    pos = torch.arange(s).repeat(b, 1)                                    # [b, s]
    return {"tokens": pos + 1000, "labels": pos + 2000, "loss_mask": (pos % 2).float(),
            "position_ids": pos, "attention_mask": None}


# --- Megatron's layout, worked by hand ------------------------------------------------------
# s = 16, cp = 2: chunks of 4, rank r keeps chunks r and 3 - r.
# s = 16, cp = 4: chunks of 2, rank r keeps chunks r and 7 - r.
BY_HAND = {(2, 0): [0, 1, 2, 3, 12, 13, 14, 15], (2, 1): [4, 5, 6, 7, 8, 9, 10, 11],
           (4, 0): [0, 1, 14, 15], (4, 1): [2, 3, 12, 13], (4, 2): [4, 5, 10, 11],
           (4, 3): [6, 7, 8, 9]}


@pytest.mark.parametrize("cp_size, cp_rank", sorted(BY_HAND))
def test_get_batch_on_this_cp_rank_keeps_chunks_r_and_2cp_minus_1_minus_r(cp_world, cp_size,
                                                                           cp_rank):
    cp_world(cp_rank, cp_size)
    batch = positions_batch()
    out = cp.get_batch_on_this_cp_rank(batch)
    expected = torch.tensor(BY_HAND[cp_size, cp_rank]).repeat(2, 1)
    assert torch.equal(out["position_ids"], expected)
    assert torch.equal(out["tokens"], expected + 1000)
    assert torch.equal(out["labels"], expected + 2000)
    assert torch.equal(out["loss_mask"], (expected % 2).float())
    assert out["attention_mask"] is None
    assert torch.equal(batch["position_ids"], torch.arange(16).repeat(2, 1))   # input untouched
    assert cp.positions_on_rank(16, cp_rank, cp_size) == BY_HAND[cp_size, cp_rank]


def test_get_batch_on_this_cp_rank_cuts_dim_2_of_the_attention_mask(cp_world):
    cp_world(1, 2)
    mask = torch.arange(16).view(1, 1, 16, 1).expand(2, 1, 16, 16)      # row i holds i
    out = cp.get_batch_on_this_cp_rank({"attention_mask": mask})["attention_mask"]
    assert out.shape == (2, 1, 8, 16)
    assert out[0, 0, :, 0].tolist() == BY_HAND[2, 1]


def test_get_batch_on_this_cp_rank_at_cp_1_returns_the_batch_as_it_is(cp_world):
    cp_world(0, 1)
    batch = positions_batch(s=5)                       # any length when nothing is cut
    out = cp.get_batch_on_this_cp_rank(batch)
    assert all(out[k] is batch[k] for k in batch)


def test_get_batch_on_this_cp_rank_refuses_a_length_not_divisible_by_2cp(cp_world):
    cp_world(0, 4)
    batch = {"tokens": torch.zeros(2, 16, dtype=torch.long),
             "labels": torch.zeros(2, 12, dtype=torch.long)}
    with pytest.raises(ValueError, match=r"batch\['labels'\].*s=12 is not divisible by 2\*cp = 8 "
                                         r"\(cp=4\).*multiple of 8, e.g. 8 or 16"):
        cp.get_batch_on_this_cp_rank(batch)
    with pytest.raises(ValueError, match=r"batch\['tokens'\] must be a tensor with a sequence dim 1"):
        cp.get_batch_on_this_cp_rank({"tokens": torch.zeros(16)})


def test_reordering_indices_between_rank_order_and_natural_order():
    # cp = 2, s = 8: chunks of 2; rank 0 holds chunks 0, 3 and rank 1 chunks 1, 2
    assert cp.natural_to_rank_order(2, 8).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    assert cp.rank_order_to_natural(2, 8).tolist() == [0, 1, 4, 5, 6, 7, 2, 3]
    gathered = torch.tensor(BY_HAND[4, 0] + BY_HAND[4, 1] + BY_HAND[4, 2] + BY_HAND[4, 3])
    assert gathered[cp.rank_order_to_natural(4, 16)].tolist() == list(range(16))


# --- the ring's causal pattern ---------------------------------------------------------------
@pytest.mark.parametrize("cp_size", [2, 4])
def test_block_pairs_of_the_ring_cover_exactly_the_causal_mask(cp_size):
    """For every (query rank, key/value rank) the rows x cols that block_pair keeps, with the
    diagonal mask where it says so, are exactly the pairs with key position <= query position."""
    chunk, s = 3, 2 * cp_size * 3
    for q_rank in range(cp_size):
        q_pos = torch.tensor(cp.positions_on_rank(s, q_rank, cp_size))
        for kv_rank in range(cp_size):
            k_pos = torch.tensor(cp.positions_on_rank(s, kv_rank, cp_size))
            allowed = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)        # brute force, [2c, 2c]
            rows, cols, diagonal = ring_attention.block_pair(kv_rank, q_rank, True, chunk)
            kept = torch.zeros(2 * chunk, 2 * chunk, dtype=torch.bool)
            kept[rows, cols] = True
            if diagonal:
                kept &= torch.ones_like(kept).tril()
            assert torch.equal(kept, allowed), (q_rank, kv_rank)
            assert diagonal == (q_rank == kv_rank)
            if q_rank != kv_rank:          # load balance: every other step is one half-block
                assert int(kept.sum()) == 2 * chunk * chunk


def test_block_pairs_without_the_causal_mask_are_whole_blocks():
    assert ring_attention.block_pair(3, 0, False, 4) == (slice(0, 8), slice(0, 8), False)


# --- the log-sum-exp merge and the block backward --------------------------------------------
def sdpa(q, k, v, causal=False):
    """torch's attention on sequence-first [s, b, n, d] tensors."""
    out = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)),
                                         is_causal=causal)
    return out.permute(2, 0, 1, 3)


def qkv(sq=6, sk=10, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(sq, 2, 3, 8, generator=gen, dtype=torch.float64),
            torch.randn(sk, 2, 3, 8, generator=gen, dtype=torch.float64),
            torch.randn(sk, 2, 3, 8, generator=gen, dtype=torch.float64))


def test_merging_two_key_blocks_by_log_sum_exp_equals_attention_over_all_keys():
    q, k, v = qkv()
    scale = 8 ** -0.5
    out, lse = block_attention.block_forward(q, k[:4], v[:4], False, scale)
    out_b, lse_b = block_attention.block_forward(q, k[4:], v[4:], False, scale)
    merged, merged_lse = block_attention.merge(out, lse, out_b, lse_b)
    assert torch.allclose(merged, sdpa(q, k, v), atol=1e-12)
    dense_lse = torch.logsumexp(torch.einsum("qbnd,kbnd->bnqk", q, k) * scale, dim=-1)
    assert torch.allclose(merged_lse, dense_lse, atol=1e-12)


def test_block_forward_with_the_diagonal_mask_equals_causal_attention():
    q, k, v = qkv(sq=7, sk=7)
    out, _ = block_attention.block_forward(q, k, v, True, 8 ** -0.5)
    assert torch.allclose(out, sdpa(q, k, v, causal=True), atol=1e-12)


def test_block_backward_summed_over_key_blocks_equals_autograd():
    q, k, v = qkv(sq=8, sk=8, seed=1)
    dout = torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = sdpa(*leaves, causal=True)
    out.backward(dout)
    scale = 8 ** -0.5
    _, lse = block_attention.block_forward(q, k, v, True, scale)
    delta = block_attention.softmax_delta(dout, out.detach())
    # block 1: keys 0-3 causal against queries 0-3; block 2: keys 0-3 fully against queries 4-7;
    # block 3: keys 4-7 causal against queries 4-7 (keys 4-7 against queries 0-3: all masked)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for rows, cols, diagonal in ((slice(0, 4), slice(0, 4), True),
                                 (slice(4, 8), slice(0, 4), False),
                                 (slice(4, 8), slice(4, 8), True)):
        gq, gk, gv = block_attention.block_backward(q[rows], k[cols], v[cols], dout[rows],
                                                    lse[..., rows], delta[..., rows], diagonal,
                                                    scale)
        dq[rows] += gq
        dk[cols] += gk
        dv[cols] += gv
    for name, mine, expected in (("dq", dq, leaves[0].grad), ("dk", dk, leaves[1].grad),
                                 ("dv", dv, leaves[2].grad)):
        assert torch.allclose(mine, expected, atol=1e-12), name


# --- bad inputs -------------------------------------------------------------------------------
def test_attention_inputs_are_checked_with_the_numbers_named():
    good = torch.zeros(8, 2, 4, 8)
    check = cp.check_attention_inputs
    with pytest.raises(ValueError, match="unknown comm_type 'ring': valid ones are 'p2p', 'a2a', "
                                         "'allgather'"):
        check(good, good, good, "ring", True, 2)
    with pytest.raises(ValueError, match="n=4 heads is not divisible by cp=8"):
        check(good, good, good, "a2a", True, 8)
    check(good, good, good, "p2p", True, 8)          # only a2a splits heads
    odd = torch.zeros(5, 2, 4, 8)
    with pytest.raises(ValueError, match=r"s/cp = 5 tokens.*s = 10 must be a multiple of "
                                         r"2\*cp = 4"):
        check(odd, odd, odd, "p2p", True, 2)
    with pytest.raises(ValueError, match=r"same shape.*\(8, 2, 4, 8\), \(8, 2, 2, 8\)"):
        check(good, torch.zeros(8, 2, 2, 8), good, "p2p", True, 2)
    with pytest.raises(ValueError, match=r"k must be a 4-d tensor.*got \(8, 32\)"):
        check(good, torch.zeros(8, 32), good, "p2p", True, 2)
    with pytest.raises(ValueError, match="causal must be True or False, got 'yes'"):
        check(good, good, good, "p2p", "yes", 2)


def test_sequence_length_check_suggests_the_nearest_valid_lengths():
    with pytest.raises(ValueError, match=r"s=10 .* 2\*cp = 4 \(cp=2\).*e\.g\. 8 or 12"):
        layout.check_sequence_length(10, 2)
    with pytest.raises(ValueError, match=r"s=3 .*e\.g\. 8$"):
        layout.check_sequence_length(3, 4)


def test_attention_at_cp_1_is_plain_causal_attention(world):
    q, k, v = (t.float() for t in qkv(sq=8, sk=8))
    for comm_type in cp.COMM_TYPES:
        out = cp.attention(q, k, v, comm_type=comm_type)
        assert torch.allclose(out, sdpa(q, k, v, causal=True), atol=1e-6)
