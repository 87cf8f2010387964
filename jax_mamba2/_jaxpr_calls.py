"""Where the primitives that call a jaxpr keep it, for code that walks or evaluates jaxprs through them."""

# Call primitives and the parameter that holds their closed jaxpr (a remat'd loop's known half is a closed_call;
# jax 0.11 names that primitive eval_jaxpr; older versions name jit pjit).
CALL_JAXPRS = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "eval_jaxpr": "call_jaxpr"}

# Primitives that call a jaxpr under rules of their own (differentiation, batching), and where it is: evaluated as
# it is, each is its call jaxpr.
CUSTOM_RULE_JAXPRS = {"custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr", "custom_vmap_call": "call"}
