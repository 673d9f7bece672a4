"""A user-supplied worker extension: the plugin must compose with it, not replace it."""


class UserExtension:
    def user_ping(self, x: int) -> int:
        return x + 1
