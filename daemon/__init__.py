"""The process: command line, configuration, server lifecycle.

May import `api`, `engine` and `registry`.
"""
