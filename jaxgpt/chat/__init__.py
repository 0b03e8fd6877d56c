"""Chat: conversations rendered with a chat template into tokens and a loss mask (fine-tuning,
jaxgpt/data/conversations.py) or into a prompt (`python -m jaxgpt.sample RUN --chat`).

    template.py  the tokenizer's own Jinja chat template (rendered as transformers renders it) or a
                 built-in one; messages checked; assistant tokens found; prompts that fit the context
    bundled.py   the generated chat set `data.chat=bundled` trains on (no download)
"""
