"""`kvserve router`: one OpenAI-compatible front for several kvserve servers (seed §7)."""
