"""`kvserve generate` and `kvserve chat`: the engine from the terminal, streaming as it goes."""

from __future__ import annotations

import argparse
import sys

from kvserve.engine_args import add_engine_args, add_sampling_args, engine_config_from_args, sampling_params_from_args


def register(subparsers) -> None:
    gen = subparsers.add_parser("generate", help="complete one prompt and print the text as it comes")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--chat-template", action="store_true", help="send the prompt as a user message through the chat template")
    add_engine_args(gen)
    add_sampling_args(gen, max_tokens=128)
    gen.set_defaults(func=_generate)

    chat = subparsers.add_parser("chat", help="talk with the model (interactive; /reset, /exit)")
    chat.add_argument("--system", default=None, help="a system message")
    add_engine_args(chat)
    add_sampling_args(chat, max_tokens=512)
    chat.set_defaults(func=_chat)


def _llm(args: argparse.Namespace):
    from kvserve.engine.describe import describe
    from kvserve.engine.llm import LLM

    llm = LLM.from_config(engine_config_from_args(args))
    print(describe(llm.engine), file=sys.stderr)
    return llm


def _stream(out) -> None:
    sys.stdout.write(out.outputs[0].delta_text)
    sys.stdout.flush()


def _generate(args: argparse.Namespace) -> int:
    params = sampling_params_from_args(args)
    llm = _llm(args)
    if args.chat_template:
        llm.chat([{"role": "user", "content": args.prompt}], params, on_output=_stream)
    else:
        llm.generate(args.prompt, params, on_output=_stream)
    sys.stdout.write("\n")
    return 0


def _chat(args: argparse.Namespace) -> int:
    params = sampling_params_from_args(args)
    llm = _llm(args)
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            sys.stdout.write("\n> ")
            sys.stdout.flush()
        line = sys.stdin.readline()
        if not line:
            break
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            break
        if text == "/reset":
            messages = list(system)
            continue
        messages.append({"role": "user", "content": text})
        reply = llm.chat(messages, params, on_output=_stream)[0].outputs[0].text
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": reply})
    return 0
