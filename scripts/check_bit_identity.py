"""Bit identity across a change that must not change the numbers (issue 49).

Trains the smoke recipe's model (configs: experiment=smoke attention=X; the config's Adam,
fused as the config resolves it on CPU/32-true) on seeded synthetic batches for STEPS steps
(default 300), on 1 CPU thread, then decodes (greedy and beam with the KV cache; MLA's
absorbed path) and saves, or compares with what was saved, the state_dict and the tokens::

    git worktree add /tmp/before <old commit>; cp scripts/check_bit_identity.py /tmp/before/scripts/
    cd /tmp/before && OMP_NUM_THREADS=1 PYTHONPATH=$PWD/src BITREF=/tmp/bitref \
        python scripts/check_bit_identity.py save
    cd - && OMP_NUM_THREADS=1 BITREF=/tmp/bitref python scripts/check_bit_identity.py compare

``save`` or ``compare`` may be followed by design names (configs/attention); default: all
eight. ``compare`` exits 1 unless every tensor is ``torch.equal`` and the tokens are the same.
"""

import os
import sys

from multihead.cli import register_resolvers

import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from multihead.model.decoding import beam_search, greedy_decode
from multihead.model.factory import build_model

torch.set_num_threads(1)
MODE = sys.argv[1]
REF = os.environ.get("BITREF", "outputs/bitref")  # where save writes and compare reads
STEPS = int(os.environ.get("STEPS", 300))
DESIGNS = ["mha", "gqa", "mqa", "moh", "talking_heads", "group_mlp", "head_attention", "mla"]
V, PAD, BOS, EOS = 1000, 0, 1, 2
register_resolvers()  # the configs' ${full_precision:...}, as train.py resolves them

failures = []
for design in sys.argv[2:] or DESIGNS:
    with initialize_config_dir(os.path.abspath("configs"), version_base="1.3"):
        cfg = compose("train", overrides=["experiment=smoke", f"attention={design}"])
    torch.manual_seed(1234)
    model = build_model(cfg, V, PAD)
    opt = instantiate(cfg.module.optimizer)(model.parameters())
    gen = torch.Generator().manual_seed(7)
    model.train()
    for _ in range(STEPS):
        src = torch.randint(3, V, (8, 12), generator=gen)
        src[4:, 9:] = PAD
        tgt = torch.randint(3, V, (8, 11), generator=gen)
        tgt[5:, 7:] = PAD
        logits = model(src, tgt[:, :-1])
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, V), tgt[:, 1:].reshape(-1), ignore_index=PAD, label_smoothing=0.1
        )
        aux = model.aux_loss()
        if aux is not None:
            loss = loss + 0.01 * aux
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    src = torch.randint(3, V, (4, 10), generator=gen)
    src[2:, 7:] = PAD
    with torch.no_grad():
        out = {
            "greedy": greedy_decode(model, src, bos_id=BOS, eos_id=EOS, max_len_a=1.0, max_len_b=5),
            "beam": beam_search(
                model,
                src,
                bos_id=BOS,
                eos_id=EOS,
                max_len_a=1.0,
                max_len_b=5,
                beam_size=3,
                length_penalty=1.0,
            ),
        }
    state = {k: v.clone() for k, v in model.state_dict().items()}
    path = f"{REF}/{design}.pt"
    if MODE == "save":
        os.makedirs(REF, exist_ok=True)
        torch.save({"state": state, "decoded": out, "fused": cfg.module.optimizer.fused}, path)
        print(design, "saved", len(state), "tensors, fused Adam:", cfg.module.optimizer.fused)
        continue
    ref = torch.load(path)
    keys_same = list(ref["state"]) == list(state)
    equal = keys_same and all(torch.equal(ref["state"][k], state[k]) for k in state)
    decoded_same = ref["decoded"] == out
    print(
        design,
        f"keys same: {keys_same}, all tensors torch.equal: {equal}, decoded same: {decoded_same}",
    )
    model.load_state_dict(ref["state"], strict=True)
    if not (equal and decoded_same):
        failures.append(design)
print("FAILED:" if failures else "ALL BIT-IDENTICAL", failures)
sys.exit(1 if failures else 0)
