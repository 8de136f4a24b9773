"""A vLLM engine with the kvstore connector, driven by JSON commands on stdin.

Run by the vLLM tests in a subprocess (vLLM spawns workers, so it needs the `__main__` guard,
and a test must be able to stop the daemon while the engine lives on):

    python -m tests.vllm.vllm_runner '{"model": DIR, "target": "unix:///...", ...}'

then one JSON command per line on stdin, one `RESULT {json}` line per command on stdout:
`{"op": "generate", "prompts": [...], "max_tokens": N}` -> outputs, cached tokens, seconds;
`{"op": "reset"}` -> whether vLLM's prefix cache was emptied; `{"op": "abort_mid_load",
"abort": ids, "wait_s": S, "prompts": [...]}` -> a request aborted S seconds after its
submission, then `generate`; `{"op": "quit"}`.

`make_model(dir)` builds the tiny random Llama and its locally trained tokenizer.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

WORDS = ("cache", "block", "token", "prefix", "layer", "head", "engine", "store", "tier", "disk",
         "memory", "host", "daemon", "key", "value", "tensor", "model", "prompt", "reuse", "hit",
         "miss", "fetch", "publish", "lookup", "salt", "chain", "hash", "page", "attention",
         "query", "batch", "sequence", "decode", "prefill", "latency", "throughput")
TOP_K = 5  # log-probabilities returned per generated token


def corpus(n: int = 400, seed: int = 0) -> list[str]:
    """Deterministic pseudo-sentences: enough text for a byte-level BPE of ~1000 tokens."""
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 20))) + "."
            for _ in range(n)]


def corpus_ids(model: Path, seed: int, n: int, sentences: int = 40) -> list[int]:
    """The first `n` token ids of `corpus(sentences, seed)` under `model`'s tokenizer."""
    from transformers import AutoTokenizer

    text = " ".join(corpus(sentences, seed=seed))
    ids: list[int] = AutoTokenizer.from_pretrained(model)(text)["input_ids"]
    assert len(ids) >= n, f"the corpus gives {len(ids)} tokens, {n} wanted"
    return ids[:n]


def make_model(path: Path, *, layers: int = 2, dtype: str = "float32",
               positions: int = 2048) -> Path:
    """A random-weight Llama (2 layers, 4 heads, 2 KV heads, head_dim 64) with a byte-level
    BPE tokenizer trained here: no model hub needed."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    cfg = LlamaConfig(vocab_size=fast.vocab_size, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, max_position_embeddings=positions, bos_token_id=0,
                      eos_token_id=1, pad_token_id=2, tie_word_embeddings=False,
                      # Wider than the default 0.02, so greedy tokens depend on the context
                      # (a near-zero init repeats one token whatever the prompt); the engine
                      # fixture refuses a model that repeats one token on its probe prompt.
                      initializer_range=0.1)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(getattr(torch, dtype))
    model.save_pretrained(path, safe_serialization=True)
    fast.save_pretrained(path)
    return path


def build_llm(opts: dict[str, Any]) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    extra = {"kvstore.target": opts["target"], "kvstore.deadline_s": opts.get("deadline_s", 1.0)}
    extra.update(opts.get("extra", {}))
    ktc = KVTransferConfig(kv_connector=opts.get("connector", "KVStoreConnector"),
                           kv_connector_module_path=opts.get("module",
                                                            "kvstore.client.integrations.vllm"),
                           kv_role="kv_both", kv_connector_extra_config=extra)
    return LLM(model=opts["model"], dtype=opts.get("dtype", "float32"), enforce_eager=True,
               block_size=opts.get("block_size", 32), max_model_len=opts.get("max_model_len", 1024),
               max_num_seqs=4, seed=0, kv_transfer_config=ktc,
               **opts.get("llm_kwargs", {}))


def generate(llm: Any, cmd: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=cmd.get("max_tokens", 16),
                            ignore_eos=True, logprobs=TOP_K)
    # A string is a text prompt, a list its token ids; a dict goes as is (e.g. with a
    # "cache_salt").
    prompts = [{"prompt": p} if isinstance(p, str) else p if isinstance(p, dict)
               else {"prompt_token_ids": p} for p in cmd["prompts"]]
    # Per-prompt `kv_transfer_params` (None: none), e.g. {"kvstore_end_session": True}.
    transfer = cmd.get("kv_transfer_params")
    if transfer:
        params = [params.clone() if t is None else SamplingParams(
            temperature=0.0, max_tokens=cmd.get("max_tokens", 16), ignore_eos=True,
            logprobs=TOP_K, extra_args={"kv_transfer_params": t}) for t in transfer]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return {"seconds": time.perf_counter() - start,
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "text": [o.outputs[0].text for o in outs],
            "prompt_tokens": [len(o.prompt_token_ids or []) for o in outs],
            "cached": [o.num_cached_tokens or 0 for o in outs],
            # Log-probabilities of the chosen tokens: a far finer check than the tokens that
            # KV loaded from the store is what the engine computed itself.
            "logprobs": [[step[t].logprob for step, t in zip(o.outputs[0].logprobs or [],
                                                             o.outputs[0].token_ids, strict=True)]
                         for o in outs],
            # The top-k alternatives of every step, `{token id: logprob}`: a wrong KV block
            # moves them even where the greedy token survives.
            "top": [[{str(t): lp.logprob for t, lp in step.items()}
                     for step in o.outputs[0].logprobs or []] for o in outs]}


def abort_mid_load(llm: Any, cmd: dict[str, Any]) -> dict[str, Any]:
    """Submit `cmd["abort"]` (token ids), give the engine `cmd["wait_s"]` to take it up (its
    load under way), abort it, then generate `cmd["prompts"]` as `generate` does; the
    aborted request's id is "aborted"."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=cmd.get("max_tokens", 16),
                            ignore_eos=True)
    engine.add_request("aborted", {"prompt_token_ids": cmd["abort"]}, params)
    time.sleep(cmd["wait_s"])  # the engine core runs in its own process meanwhile
    engine.abort_request(["aborted"])
    print("kvstore-test: aborted request 'aborted'", file=sys.stderr, flush=True)
    return generate(llm, cmd)


def reset(llm: Any) -> dict[str, Any]:
    # The prefix cache resets only once no request holds blocks: retry briefly.
    for _ in range(50):
        if llm.reset_prefix_cache():
            return {"reset": True}
        time.sleep(0.1)
    return {"reset": False}


def main() -> None:
    opts = json.loads(sys.argv[1])
    llm = build_llm(opts)
    print("RESULT " + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        ops = {"generate": generate, "abort_mid_load": abort_mid_load,
               "reset": lambda llm, _: reset(llm)}
        result = ops[cmd["op"]](llm, cmd)
        print("RESULT " + json.dumps(result), flush=True)
    del llm  # shuts the engine core process down


if __name__ == "__main__":
    main()
