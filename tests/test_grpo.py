import pytest
import torch

from workers.grpo import clipped_loss, group_advantages


def test_advantages_are_group_normalised_and_zero_for_equal_rewards():
    adv = group_advantages([1.0, 0.0, 0.0, 1.0])
    assert abs(sum(adv)) < 1e-9 and adv[0] > 0 > adv[1]
    assert group_advantages([1.0, 1.0, 1.0]) == [0.0, 0.0, 0.0]


def test_loss_is_token_level_and_masks_tool_tokens():
    new = [torch.tensor([-1.0, -2.0, -3.0], requires_grad=True)]
    old = [torch.tensor([-1.0, -5.0, -3.0])]
    mask = [torch.tensor([1.0, 0.0, 1.0])]
    loss, st = clipped_loss(new, old, mask, [2.0], clip_eps=0.2, total_tokens=2)
    # ratio 1 on the two policy tokens: loss = -(1*2 + 1*2)/2; the masked token's ratio is ignored
    assert torch.isclose(loss, torch.tensor(-2.0))
    loss.backward()
    assert new[0].grad[1] == 0 and new[0].grad[0] != 0
    assert st.tokens == 2 and st.max_abs_log_ratio == 0.0


def test_clip_stops_gradient_beyond_the_range():
    new = [torch.tensor([0.0], requires_grad=True)]
    old = [torch.tensor([-1.0])]  # ratio e > 1.2
    loss, st = clipped_loss(new, old, [torch.ones(1)], [1.0], clip_eps=0.2, total_tokens=1)
    loss.backward()
    assert new[0].grad.item() == 0.0 and st.clip_frac == 1.0


def test_micro_batches_add_up_to_the_batch_loss_and_gradient():
    """Each micro-batch divides by the batch's policy-token count: the sum over any split is the batch's loss."""
    gen = torch.Generator().manual_seed(0)
    lengths = [3, 7, 1, 5, 4]
    new = [torch.randn(n, generator=gen).mul(0.1).sub(2.0).requires_grad_() for n in lengths]
    old = [x.detach() + torch.randn(x.shape, generator=gen).mul(0.3) for x in new]
    masks = [(torch.rand(n, generator=gen) > 0.3).float() for n in lengths]
    adv = [1.0, -0.5, 2.0, 0.0, -1.5]
    total = int(sum(int(m.sum()) for m in masks))
    whole, st = clipped_loss(new, old, masks, adv, 0.2, total)
    g_whole = torch.autograd.grad(whole, new)
    parts = [clipped_loss(new[i:j], old[i:j], masks[i:j], adv[i:j], 0.2, total)[0] for i, j in ((0, 2), (2, 3), (3, 5))]
    split = sum(parts)
    g_split = torch.autograd.grad(split, new)
    assert torch.isclose(split, whole, atol=1e-7)
    assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(g_split, g_whole))
    assert st.tokens == total and 0.0 < st.clip_frac < 1.0


# --- advantages and the decoupled objective ---------------------------------------------------------

from workers.grpo import TokenCounts, decoupled_loss  # noqa: E402


def test_dr_grpo_advantages_are_centred_but_not_scaled():
    assert group_advantages([1.0, 0.0, 0.0, 0.0], "dr_grpo") == [0.75, -0.25, -0.25, -0.25]
    assert group_advantages([0.5, 0.5], "dr_grpo") == [0.0, 0.0]
    grpo = group_advantages([1.0, 0.0, 0.0, 0.0])
    assert grpo[0] > 1.5   # divided by the std (0.433): the rare success weighs more


def _decoupled(new, prox, behav, masks, adv, **kw):
    args = dict(clip_eps=0.2, is_cap=2.0, is_mask=0.0, dual_clip=0.0, total_tokens=sum(int(m.sum()) for m in masks))
    args.update(kw)
    return decoupled_loss(new, prox, behav, masks, adv, **args)


def test_on_fresh_data_the_decoupled_gradient_is_the_behaviour_objectives():
    """One mini-batch on data these weights generated: prox = behaviour = current, both are plain policy gradient."""
    gen = torch.Generator().manual_seed(1)
    new = [torch.randn(n, generator=gen).sub(1.0).requires_grad_() for n in (4, 6, 3)]
    masks = [torch.tensor([1.0, 1, 0, 1]), torch.ones(6), torch.tensor([0.0, 1, 1])]
    adv = [1.0, -0.7, 0.3]
    fixed = [x.detach().clone() for x in new]
    a, st_a = clipped_loss(new, fixed, masks, adv, 0.2, 11)
    b, st_b = _decoupled(new, fixed, fixed, masks, adv)
    ga, gb = torch.autograd.grad(a, new), torch.autograd.grad(b, new)
    assert torch.isclose(a, b) and all(torch.allclose(x, y) for x, y in zip(ga, gb))
    assert st_b.counts.tokens == 11 and st_b.counts.truncated == 0 and st_b.clip_frac == 0.0


def test_a_stale_token_keeps_a_truncated_weight_instead_of_losing_its_gradient():
    """prox / behaviour = e^2 > 1.2: the behaviour objective clips the token to no gradient, decoupled weighs it is_cap."""
    new = [torch.tensor([0.0], requires_grad=True)]
    behav = [torch.tensor([-2.0])]
    loss_b, st_b = clipped_loss(new, behav, [torch.ones(1)], [1.0], 0.2, 1)
    (g_b,) = torch.autograd.grad(loss_b, new)
    assert g_b.item() == 0.0 and st_b.counts.clipped_pos == 1
    loss_d, st_d = _decoupled(new, [new[0].detach()], behav, [torch.ones(1)], [1.0])
    (g_d,) = torch.autograd.grad(loss_d, new)
    assert g_d.item() == pytest.approx(-2.0)   # d(-w * ratio * A)/d new = -is_cap at ratio 1
    assert st_d.counts.truncated == 1 and st_d.counts.weight_sum == 2.0


def test_is_mask_leaves_out_tokens_with_extreme_weights():
    new = [torch.tensor([0.0, 0.0, 0.0], requires_grad=True)]
    behav = [torch.tensor([-3.0, 0.1, 3.0])]   # weights e^3, e^-0.1, e^-3
    loss, st = _decoupled(new, [new[0].detach()], behav, [torch.ones(3)], [1.0], is_mask=5.0, total_tokens=3)
    (g,) = torch.autograd.grad(loss, new)
    assert g[0] == 0 and g[2] == 0 and g[1] != 0
    assert (st.counts.tokens, st.counts.masked) == (1, 2)
    assert TokenCounts(tokens=1, masked=2).rates()["is_masked_frac"] == pytest.approx(2 / 3)


def test_dual_clip_bounds_the_term_of_a_negative_advantage():
    """Ratio e^2.3 ~ 10 against the proximal policy with advantage -1: 10x weight without dual clip, none with it."""
    new = [torch.tensor([2.3], requires_grad=True)]
    prox = [torch.tensor([0.0])]
    free, _ = _decoupled(new, prox, prox, [torch.ones(1)], [-1.0])
    bounded, st = _decoupled(new, prox, prox, [torch.ones(1)], [-1.0], dual_clip=3.0)
    assert free.item() == pytest.approx(torch.exp(torch.tensor(2.3)).item(), rel=1e-5)
    assert bounded.item() == pytest.approx(3.0)
    (g,) = torch.autograd.grad(bounded, new)
    assert g.item() == 0.0 and st.counts.clipped_neg == 1 and st.counts.neg == 1


def test_clip_fractions_are_split_by_the_sign_of_the_advantage():
    new = [torch.tensor([1.0, 1.0], requires_grad=True), torch.tensor([0.05, 0.0], requires_grad=True)]
    prox = [torch.zeros(2), torch.zeros(2)]
    _loss, st = _decoupled(new, prox, prox, [torch.ones(2), torch.ones(2)], [1.0, -1.0])
    rates = st.counts.rates()
    assert (rates["clip_frac_pos"], rates["clip_frac_neg"], rates["clip_frac"]) == (1.0, 0.0, 0.5)


def test_decoupled_micro_batches_add_up_to_the_batch_loss_and_gradient():
    gen = torch.Generator().manual_seed(0)
    lengths = [3, 7, 1, 5, 4]
    new = [torch.randn(n, generator=gen).mul(0.1).sub(2.0).requires_grad_() for n in lengths]
    prox = [x.detach() + torch.randn(x.shape, generator=gen).mul(0.2) for x in new]
    behav = [x + torch.randn(x.shape, generator=gen).mul(0.5) for x in prox]
    masks = [(torch.rand(n, generator=gen) > 0.3).float() for n in lengths]
    adv = [1.0, -0.5, 2.0, 0.0, -1.5]
    kw = dict(clip_eps=0.2, is_cap=1.5, is_mask=4.0, dual_clip=3.0, total_tokens=17.0)
    whole, st = decoupled_loss(new, prox, behav, masks, adv, **kw)
    parts = sum(decoupled_loss(new[i:j], prox[i:j], behav[i:j], masks[i:j], adv[i:j], **kw)[0]
                for i, j in ((0, 2), (2, 3), (3, 5)))
    assert torch.isclose(parts, whole, atol=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(torch.autograd.grad(parts, new),
                                                                torch.autograd.grad(whole, new)))
    assert 0 < st.counts.truncated < st.counts.tokens


def test_token_counts_add_up_and_keep_the_max():
    a, b = TokenCounts(tokens=3, clipped=1, log_ratio_max=0.5), TokenCounts(tokens=2, clipped=1, log_ratio_max=0.2)
    a.add(b)
    assert (a.tokens, a.clipped, a.log_ratio_max) == (5, 2, 0.5)
    assert TokenCounts.from_list(a.as_list()) == a


def test_trust_clip_stops_pushing_a_token_that_already_moved_its_advantages_way():
    """w = prox / behaviour: 0.5 (fell) and 1.5 (rose). A negative advantage stops pushing the fallen token,
    a positive one the risen token; each keeps the token that moved against it, with its truncated weight."""
    new = [torch.tensor([0.0, 0.0], requires_grad=True)]
    behav = [torch.log(torch.tensor([2.0, 1 / 1.5]))]   # prox = 0: w = 0.5, 1.5
    for adv, kept in ((-1.0, 1), (1.0, 0)):
        loss, st = _decoupled(new, [new[0].detach()], behav, [torch.ones(2)], [adv], trust_clip=0.2, total_tokens=2)
        (g,) = torch.autograd.grad(loss, new)
        assert g[1 - kept] == 0 and g[kept] != 0 and (st.counts.tokens, st.counts.masked) == (1, 1)
    off, _ = _decoupled(new, [new[0].detach()], behav, [torch.ones(2)], [-1.0], trust_clip=0.0, total_tokens=2)
    assert all(torch.autograd.grad(off, new)[0] != 0)
