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
