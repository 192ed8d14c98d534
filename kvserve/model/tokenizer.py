"""The model's tokenizer and chat template, behind the few calls the engine makes."""

from __future__ import annotations

from typing import Any, Sequence

from kvserve.errors import InvalidRequestError


class Tokenizer:
    def __init__(self, hf_tokenizer, eos_token_ids: Sequence[int] = ()):
        self.hf = hf_tokenizer
        ids = list(eos_token_ids)
        if hf_tokenizer.eos_token_id is not None and hf_tokenizer.eos_token_id not in ids:
            ids.append(hf_tokenizer.eos_token_id)
        self.eos_token_ids: tuple[int, ...] = tuple(ids)
        self.vocab_size = len(hf_tokenizer)
        # Incremental detokenization decodes two short windows per request per step; the
        # transformers wrapper around the Rust tokenizer costs ~3x the decode itself
        # (~2 ms of a 64-request step). Call the Rust tokenizer directly where the wrapper
        # would add nothing: a fast tokenizer with no space clean-up.
        backend = getattr(hf_tokenizer, "_tokenizer", None)
        plain = not getattr(hf_tokenizer, "clean_up_tokenization_spaces", True)
        self._fast_decode = backend.decode if plain and hasattr(backend, "decode") else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self._fast_decode is not None:
            return self._fast_decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        return self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str]:
        return self.hf.convert_ids_to_tokens(list(token_ids))

    @property
    def chat_template(self) -> str | None:
        return getattr(self.hf, "chat_template", None)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render messages to the prompt text; role markers are part of the token prefix."""
        if not (chat_template or self.chat_template):
            raise InvalidRequestError("this model has no chat template; use a completion prompt", "messages")
        try:
            return self.hf.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
                **template_kwargs,
            )
        except Exception as exc:  # jinja errors from user-shaped messages
            raise InvalidRequestError(f"cannot apply the chat template: {exc}", "messages") from exc

    def encode_chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        # the template already wrote any BOS it wants; don't add another
        return self.encode(self.apply_chat_template(messages, **kwargs), add_special_tokens=False)
