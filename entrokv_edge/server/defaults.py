"""The server's defaults, in one place (the command's flags and build_app read them)."""
DEFAULT_PORT = 8000
DEFAULT_QUEUE = 8
DEFAULT_CONVERSATIONS = 8
DEFAULT_CONVERSATIONS_MIB = 1024
DEFAULT_MAX_TOKENS_CAP = 4096
DEFAULT_MAX_BODY_KIB = 16 << 10      # 16 MiB: a document far longer than any context, in JSON
