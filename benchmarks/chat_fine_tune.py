"""A chat fine-tune that shows what the loss mask does, side by side in one run.

    python benchmarks/chat_fine_tune.py             # 40 steps each way (about 2 min on 2 cores)
    python benchmarks/chat_fine_tune.py --write-data configs/data/same_answer_chats.jsonl

The conversations (configs/data/same_answer_chats.jsonl, made by --write-data): a user says a few
random words, once or twice, and the assistant always answers with the same sentence. With
data.assistant_only_loss (the default for chat) the loss counts the assistant turns only, which
are predictable: it falls near zero. Without, it also counts the user's random words, which no
model can predict: it stays high. Both runs are configs/chat.yaml, the second with
data.assistant_only_loss=false; the table gives the training loss (the mean over the tokens it
counts) at a few steps, and the validation loss at the end.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ANSWER = "Thank you, I have noted that down and will keep it in mind."
WORDS = ("apple river stone cloud paper orange tiger window silver garden candle rocket pepper violin "
         "marble forest tunnel copper meadow pillow lantern saddle harbor velvet cactus falcon ribbon "
         "summit walnut bucket comet island needle parrot quartz ladder bamboo magnet jacket turnip").split()


def same_answer_chats(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    chats = []
    for _ in range(count):
        messages = []
        for _ in range(rng.choice((1, 1, 2))):
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 8)))
            messages += [{"role": "user", "content": words}, {"role": "assistant", "content": ANSWER}]
        chats.append({"messages": messages})
    return chats


def write_data(path: Path, count: int = 1000) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(chat) + "\n" for chat in same_answer_chats(count)))


def run(assistant_only: bool, steps: int, workdir: Path) -> dict:
    from hyperparallel.train.config import load_config
    from hyperparallel.train.loop import train

    cfg = load_config(ROOT / "configs" / "chat.yaml", [
        f"data.files={ROOT / 'configs' / 'data' / 'same_answer_chats.jsonl'}", f"data.cache_dir={workdir / 'cache'}",
        f"data.assistant_only_loss={str(assistant_only).lower()}", f"training.steps={steps}",
        f"logging.run_dir={workdir / ('assistant' if assistant_only else 'all')}", "logging.every=1",
        "logging.progress=false", "checkpoint.every=0"])
    summary = train(cfg)
    losses = {r["step"]: r["loss"] for r in summary["records"] if "loss" in r}
    val = [r["val_loss"] for r in summary["records"] if "val_loss" in r]
    return {"losses": losses, "val_loss": val[-1] if val else None}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--write-data", default=None, metavar="PATH", help="write the conversations there and exit")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.write_data:
        write_data(Path(args.write_data))
        return
    with tempfile.TemporaryDirectory(prefix="hp-chat-") as tmp:
        results = {label: run(flag, args.steps, Path(tmp)) for label, flag in
                   (("assistant_only_loss: true", True), ("assistant_only_loss: false", False))}
    shown = sorted({1, 5, 10, 20, 30, args.steps} & set(range(1, args.steps + 1)))
    print(f"\nchat fine-tune, configs/chat.yaml: the training loss at step ... (the validation loss after step {args.steps})")
    print("| " + " | ".join(["run".ljust(26), *[f"step {s:>3}" for s in shown], "validation"]) + " |")
    print("| " + " | ".join(["-" * 26, *["-" * 8 for _ in shown], "-" * 10]) + " |")
    for label, r in results.items():
        print("| " + " | ".join([label.ljust(26), *[f"{r['losses'][s]:>8.3f}" for s in shown],
                                 f"{r['val_loss']:>10.3f}"]) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
