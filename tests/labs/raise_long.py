"""Fixture lab: raises an exception whose message is 5000 lines long (the launcher must cap it)."""
raise ValueError("\n".join(f"line {i}: " + "x" * 60 for i in range(5000)))
