"""Test patch using ctx.replace (the hot-path technique) on a plain method."""


def apply(ctx):
    def make(original):
        def method(self, x):
            return ("hot", original(self, x))

        return method

    ctx.replace("Mixin", "method", make)
