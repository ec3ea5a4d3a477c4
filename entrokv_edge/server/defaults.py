"""The server's defaults, in one place (the command's flags and build_app read them)."""
DEFAULT_PORT = 8000
DEFAULT_QUEUE = 8
DEFAULT_CONVERSATIONS = 8
DEFAULT_CONVERSATIONS_MIB = 1024
