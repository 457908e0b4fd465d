"""Reference activations: jax.nn's functions computed in float32 (float64 for float64 inputs)."""

import jax
import jax.numpy as jnp

# name -> f(x, param): the math the kernels implement (param: negative_slope or alpha, else unused).
FUNCTIONS = {
    "identity": lambda x, p: x,
    "relu": lambda x, p: jax.nn.relu(x),
    "relu6": lambda x, p: jax.nn.relu6(x),
    "leaky_relu": lambda x, p: jax.nn.leaky_relu(x, p),
    "elu": lambda x, p: jax.nn.elu(x, p),
    "sigmoid": lambda x, p: jax.nn.sigmoid(x),
    "tanh": lambda x, p: jnp.tanh(x),
    "gelu_tanh": lambda x, p: jax.nn.gelu(x, approximate=True),
    "gelu_erf": lambda x, p: jax.nn.gelu(x, approximate=False),
    "silu": lambda x, p: jax.nn.silu(x),
    "softplus": lambda x, p: jax.nn.softplus(x),
    "hard_tanh": lambda x, p: jax.nn.hard_tanh(x),
}


def activation_fwd(x, name, param):
    """The activation `name` of x, in x's dtype."""
    compute = jnp.promote_types(x.dtype, jnp.float32)
    return FUNCTIONS[name](x.astype(compute), param).astype(x.dtype)


def activation_bwd(dy, x, name, param):
    """dy * f'(x), in x's dtype."""
    compute = jnp.promote_types(x.dtype, jnp.float32)
    _, vjp = jax.vjp(lambda x: FUNCTIONS[name](x, param), x.astype(compute))
    return vjp(dy.astype(compute))[0].astype(x.dtype)
