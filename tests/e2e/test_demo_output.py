"""The demo's first run prints nothing that is not about the run: no library's notice (bitsandbytes' optional
CPU kernel package, a deprecation between peft and transformers), no progress bar of transformers' loading. The
demo's own process is run whole (assets, answers before, answers after) with the training launch replaced by an
untrained adapter, which is what the answers after training load; training's own output is `shardtune train`'s."""

from __future__ import annotations

import subprocess
import sys
import textwrap

# What a library prints that is not about the user's run; each was printed by a first demo before.
NOT_ABOUT_THE_RUN = ("Warning", "gemm_4bit_forward", "kernels", "deprecated", "Loading weights", "Traceback")

SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from shardtune.commands import demo

    def launch(cmd, root, nproc):  # in place of torchrun: an untrained adapter and one eval record
        import warnings
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        out = Path(cmd[cmd.index("--output_dir") + 1])
        with warnings.catch_warnings():  # this stand-in's own loading is not the demo's
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_pretrained(root / "model")
            get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"])).save_pretrained(out)
        (out / "metrics.jsonl").write_text(json.dumps({"type": "eval", "eval_loss": 1.0}) + "\\n")
        print("LAUNCHED", file=sys.stderr, flush=True)
        return 0

    demo._launch_train = launch
    # A smaller model and data and one prompt (what is printed does not depend on their sizes): seconds, not a minute.
    small = dict(hidden_size=64, num_layers=2, n_train=60, n_test=10, vocab_size=600)
    demo.build_demo_assets = lambda root, _build=demo.build_demo_assets: _build(root, **small)
    demo.DEMO_PROMPTS = demo.DEMO_PROMPTS[:1]
    sys.exit(demo.main(["--workdir", sys.argv[1]]))
    """
)


def test_the_first_demo_prints_no_library_notice(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "demo")], capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "before:" in proc.stdout and "after:" in proc.stdout  # both answer steps ran
    before, _, after = proc.stderr.partition("LAUNCHED")
    assert _ and "has no chat template" in before  # about the run: the demo's model has no template
    for stderr in (before, after):
        found = [s for s in NOT_ABOUT_THE_RUN if s in stderr]
        assert not found, stderr[-3000:]
