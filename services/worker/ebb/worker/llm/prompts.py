"""A model's prompts as its tokenizer sees them: text, or a chat rendered with the model's chat
template; their token ids; and the context a sequence may fill. Shared by every engine: the
stage counts tokens and checks the context before any engine sees a row."""

from __future__ import annotations

from typing import Any

Prompt = str | list[dict[str, Any]]


class PromptCodec:
    def __init__(self, model_dir: str) -> None:
        from transformers import AutoConfig, AutoTokenizer

        self.tokenizer: Any = AutoTokenizer.from_pretrained(model_dir)
        config = AutoConfig.from_pretrained(model_dir)
        self.max_context = int(getattr(config, "max_position_embeddings", 0) or 1 << 30)
        """Prompt tokens plus generated tokens that one sequence may hold."""
        self.lead = str(self.tokenizer.decode(self.tokenizer("")["input_ids"]))
        """What the tokenizer puts before any text, as text (`<s>`; "" for most)."""

    def _chat_template(self) -> None:
        if not self.tokenizer.chat_template:
            raise ValueError("the model's tokenizer has no chat template: give text prompts")

    def encode(self, prompt: Prompt) -> list[int]:
        """A prompt's token ids: text as the tokenizer makes them (its special tokens
        included), a chat rendered with the model's chat template, ready for the answer."""
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt)["input_ids"])
        self._chat_template()
        ids = self.tokenizer.apply_chat_template(
            prompt, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return list(ids)

    def render(self, prompt: Prompt) -> str:
        """A prompt as text: a chat rendered with the template, ready for the answer."""
        if isinstance(prompt, str):
            return prompt
        self._chat_template()
        return str(
            self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        )

    def server_text(self, prompt: Prompt) -> str:
        """A prompt as text for a server that tokenizes it again, special tokens added: a
        chat rendered, less the special tokens the tokenizer puts before any text (a template
        that writes the BOS, as Llama 3's does, would otherwise get a second)."""
        text = self.render(prompt)
        if isinstance(prompt, str):
            return text  # tokenized here as the server will: the same tokens
        return text.removeprefix(self.lead) if self.lead else text

    def decode(self, tokens: list[int]) -> str:
        return str(self.tokenizer.decode(tokens, skip_special_tokens=True))
