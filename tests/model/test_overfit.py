import torch

from multihead.model import beam_search, greedy_decode

from helpers.models import BOS, EOS, PAD, tiny_model


def test_tiny_model_memorises_one_pair():
    model = tiny_model(0, attention={"num_heads": 4, "num_kv_heads": 2}).train()
    src = torch.tensor([[5, 9, 13, 7, 21, EOS]])
    target = [11, 30, 4, 17, 8, 25, 6]
    tgt_in = torch.tensor([[BOS, *target]])
    tgt_out = torch.tensor([[*target, EOS]])
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(150):
        logits = model(src, tgt_in)
        loss = torch.nn.functional.cross_entropy(
            logits.view(-1, logits.shape[-1]), tgt_out.view(-1), ignore_index=PAD
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.05
    model.eval()
    limits = dict(bos_id=BOS, eos_id=EOS, max_len_a=1.2, max_len_b=10)
    assert greedy_decode(model, src, **limits) == [target]
    assert beam_search(model, src, beam_size=3, length_penalty=1.0, **limits) == [target]
