"""``retail``: a small tau-bench-style customer-service environment, generated from a seed.

The database (users, orders, products with item variants) and the customer's instruction
are a pure function of the seed. Tools: ``get_user``, ``get_order``, ``get_product``,
``cancel_order``, ``exchange_item``. Three task kinds:

* ``cancel``: cancel a pending order (reason ``no longer needed``) and report the refund
  (sum of item prices, 2 decimals);
* ``exchange``: exchange one item of a delivered order for another available variant of the
  same product and report the price difference (new - old, 2 decimals);
* ``find_pending``: report the id of the user's only pending order; the database must not change.

Reward: 1.0 iff the final database equals the expected one *and* the ``<answer>`` matches the
required answer (numbers within 0.005, ids case-insensitively with or without ``#``), else 0.0.
``info`` says which part failed.
"""

from __future__ import annotations

import copy
import json
import random
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from .base import BaseEnv, EnvSpec, ToolError, tool_schema

__all__ = ["RetailEnv"]

_PRODUCTS = [
    ("T-Shirt", {"color": ["red", "blue", "black", "white"], "size": ["S", "M", "L"]}),
    ("Water Bottle", {"capacity": ["500ml", "750ml", "1000ml"], "material": ["plastic", "steel"]}),
    ("Desk Lamp", {"color": ["black", "white", "silver"], "power": ["LED", "USB"]}),
    ("Sneakers", {"size": ["8", "9", "10", "11"], "color": ["white", "black"]}),
    ("Backpack", {"color": ["green", "navy", "black"], "size": ["small", "large"]}),
    ("Headphones", {"type": ["over-ear", "in-ear"], "color": ["black", "white", "blue"]}),
]
_FIRST = ["mia", "noah", "ava", "liam", "emma", "omar", "yuki", "lena", "ivan", "sara", "raj", "zoe"]
_LAST = ["lee", "garcia", "kim", "smith", "khan", "rossi", "silva", "novak", "ito", "brown"]
CANCEL_REASONS = ("no longer needed", "ordered by mistake")

SYSTEM_PROMPT = (
    "You are a retail customer-service agent. Use the tools to look up users, orders and "
    "products and to cancel orders or exchange items. Only pending orders can be cancelled; "
    "only delivered orders can have items exchanged. When done, reply with <answer>...</answer>."
)


def _fmt_money(x: float) -> str:
    return f"{x:.2f}"


def _opts_text(opts: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in opts.items())


TASK_KINDS = ("cancel", "exchange", "find_pending")


class RetailKnobs(BaseModel):
    """The schema of ``env.retail`` (the knobs :class:`RetailEnv` takes besides the tool latency,
    which is ``rollout.tool_latency_s``). Checked when the config is loaded: a knob of the wrong type
    or range is one line naming it and the value (:func:`check_retail_knobs`)."""

    model_config = ConfigDict(extra="forbid", strict=False)

    num_users: StrictInt = Field(3, ge=1)
    """Users in the database."""
    max_orders_per_user: StrictInt = Field(3, ge=2)
    """Each user has 1..this many orders (>= 2 so that find_pending works)."""
    task_kinds: tuple[Literal["cancel", "exchange", "find_pending"], ...] = Field(TASK_KINDS, min_length=1)
    """Task kinds drawn from."""
    max_answer_chars: StrictInt = Field(64, ge=1)
    """Longest final answer the env grades (characters)."""


def check_retail_knobs(knobs: dict, prefix: str = "env.retail") -> dict:
    """``knobs`` validated by :class:`RetailKnobs`; returns them as given (only the keys set).

    Raises:
        ValueError: one line naming the first bad knob and its value, e.g.
            ``env.retail.num_users='abc': Input should be a valid integer``; an unknown knob lists
            the known ones.
    """
    from pydantic import ValidationError

    if not isinstance(knobs, dict):
        raise ValueError(f"{prefix}={knobs!r}: must be a mapping of knobs ({sorted(RetailKnobs.model_fields)})")
    try:
        RetailKnobs.model_validate(knobs)
    except ValidationError as e:
        err = e.errors()[0]
        key = ".".join(str(p) for p in err["loc"][:1])
        if err["type"] == "extra_forbidden":
            import difflib

            m = difflib.get_close_matches(key, list(RetailKnobs.model_fields), n=1, cutoff=0.6)
            hint = f"; did you mean '{prefix}.{m[0]}'?" if m else ""
            raise ValueError(f"unknown knob '{prefix}.{key}'{hint} ({prefix} takes "
                             f"{sorted(RetailKnobs.model_fields)})") from None
        raise ValueError(f"{prefix}.{key}={knobs.get(key)!r}: {err['msg']}") from None
    return dict(knobs)


class RetailEnv(BaseEnv):
    """Procedural retail database + instruction.

    Args:
        num_users: users in the database (>= 1).
        max_orders_per_user: each user has 1..this many orders (>= 2 so that find_pending works).
        task_kinds: subset of ``("cancel", "exchange", "find_pending")`` to draw from.
        tool_latency_s, tool_latency_dist, max_answer_chars: see :class:`BaseEnv`.
    """

    name = "retail"
    TOOLS = [
        tool_schema("get_user", "Get a user's details and order ids.", {"user_id": {"type": "string"}}),
        tool_schema("get_order", "Get an order: status and items.", {"order_id": {"type": "string"}}),
        tool_schema("get_product", "Get a product's variants (item ids, options, prices, availability).",
                    {"product_id": {"type": "string"}}),
        tool_schema("cancel_order", "Cancel a pending order.",
                    {"order_id": {"type": "string"}, "reason": {"type": "string", "enum": list(CANCEL_REASONS)}}),
        tool_schema("exchange_item", "Exchange one item of a delivered order for another variant of the same product.",
                    {"order_id": {"type": "string"}, "item_id": {"type": "string"}, "new_item_id": {"type": "string"}}),
    ]

    def __init__(
        self,
        num_users: int = 3,
        max_orders_per_user: int = 3,
        task_kinds: tuple[str, ...] = ("cancel", "exchange", "find_pending"),
        **base_kw: Any,
    ):
        super().__init__(**base_kw)
        if num_users < 1 or max_orders_per_user < 2:
            raise ValueError("retail needs num_users >= 1 and max_orders_per_user >= 2")
        bad = set(task_kinds) - {"cancel", "exchange", "find_pending"}
        if bad or not task_kinds:
            raise ValueError(f"unknown retail task kinds {sorted(bad)} (cancel|exchange|find_pending)")
        self.num_users = int(num_users)
        self.max_orders_per_user = int(max_orders_per_user)
        self.task_kinds = tuple(task_kinds)
        self.db: dict = {}
        self.task: dict = {}
        self.seed: Optional[int] = None

    # ------------------------------------------------------------------ generation
    def _generate(self, seed: int) -> tuple[dict, dict]:
        """The episode's DB and task for ``seed`` (one ``random.Random(seed)`` drawn in this order)."""
        rng = random.Random(seed)
        db = self._generate_db(rng)
        return db, self._generate_task(rng, db, seed)

    def _generate_db(self, rng: random.Random) -> dict:
        """Products with variants, users with 2..max_orders_per_user orders (one pending each)."""
        products: dict[str, dict] = {}
        for name, opt_space in _PRODUCTS:
            pid = str(rng.randrange(10**9, 10**10))
            combos = [{}]
            for k, vals in opt_space.items():
                combos = [dict(c, **{k: v}) for c in combos for v in vals]
            chosen = rng.sample(combos, k=min(len(combos), rng.randint(3, 5)))
            base = rng.randint(10, 150)
            variants = {}
            for opts in chosen:
                iid = str(rng.randrange(10**9, 10**10))
                variants[iid] = {"item_id": iid, "options": opts, "price": round(base + rng.randint(0, 3000) / 100, 2),
                                 "available": rng.random() < 0.8}
            products[pid] = {"product_id": pid, "name": name, "variants": variants}
        users: dict[str, dict] = {}
        orders: dict[str, dict] = {}
        pids = list(products)
        for _ in range(self.num_users):
            first, last = rng.choice(_FIRST), rng.choice(_LAST)
            uid = f"{first}_{last}_{rng.randint(1000, 9999)}"
            n_orders = rng.randint(2, self.max_orders_per_user)
            # exactly one pending order per user (find_pending is well-posed), the rest delivered
            statuses = ["pending"] + ["delivered"] * (n_orders - 1)
            rng.shuffle(statuses)
            oids = []
            for status in statuses:
                oid = f"#W{rng.randrange(10**6, 10**7)}"
                items = []
                for pid in rng.sample(pids, k=rng.randint(1, 3)):
                    v = products[pid]["variants"][rng.choice(list(products[pid]["variants"]))]
                    items.append({"item_id": v["item_id"], "product_id": pid, "name": products[pid]["name"],
                                  "options": dict(v["options"]), "price": v["price"]})
                orders[oid] = {"order_id": oid, "user_id": uid, "status": status, "items": items}
                oids.append(oid)
            users[uid] = {"user_id": uid, "name": f"{first.title()} {last.title()}", "orders": oids}
        return {"users": users, "orders": orders, "products": products}

    def _generate_task(self, rng: random.Random, db: dict, seed: int) -> dict:
        """The first feasible task of a shuffled kind for a shuffled user of ``db``."""
        users, orders, products = db["users"], db["orders"], db["products"]
        kinds = list(self.task_kinds)
        rng.shuffle(kinds)
        uids = list(users)
        rng.shuffle(uids)
        for kind in kinds:
            for uid in uids:
                u = users[uid]
                uorders = [orders[o] for o in u["orders"]]
                if kind == "cancel":
                    o = next(o for o in uorders if o["status"] == "pending")
                    refund = round(sum(i["price"] for i in o["items"]), 2)
                    return {"kind": kind, "user_id": uid, "order_id": o["order_id"],
                                "answer": _fmt_money(refund),
                                "instruction": f"Hi, I am {u['name']} (user id {uid}). Please cancel my order "
                                               f"{o['order_id']} because I no longer need it. Then tell me how much "
                                               f"will be refunded."}
                if kind == "find_pending":
                    o = next(o for o in uorders if o["status"] == "pending")
                    return {"kind": kind, "user_id": uid, "order_id": o["order_id"], "answer": o["order_id"],
                                "instruction": f"Hi, I am {u['name']} (user id {uid}). Which of my orders has not "
                                               f"shipped yet? Answer with its order id."}
                if kind == "exchange":
                    for o in uorders:
                        if o["status"] != "delivered":
                            continue
                        for it in o["items"]:
                            alts = [v for v in products[it["product_id"]]["variants"].values()
                                    if v["available"] and v["item_id"] != it["item_id"]]
                            if alts:
                                new = rng.choice(alts)
                                diff = round(new["price"] - it["price"], 2)
                                return {
                                    "kind": kind, "user_id": uid, "order_id": o["order_id"],
                                    "item_id": it["item_id"], "new_item_id": new["item_id"],
                                    "product_id": it["product_id"], "answer": _fmt_money(diff),
                                    "instruction": f"Hi, I am {u['name']} (user id {uid}). In my order {o['order_id']} "
                                                   f"I want to exchange the {it['name']} ({_opts_text(it['options'])}) for "
                                                   f"the same product with {_opts_text(new['options'])}. Then tell me the "
                                                   f"price difference (new price minus old price).",
                                }
        raise RuntimeError(f"retail: no feasible task for seed {seed}")  # pragma: no cover

    def _expected_db(self) -> dict:
        db = copy.deepcopy(self._initial_db)
        t = self.task
        if t["kind"] == "cancel":
            db["orders"][t["order_id"]]["status"] = "cancelled"
            db["orders"][t["order_id"]]["cancel_reason"] = "no longer needed"
        elif t["kind"] == "exchange":
            db["orders"][t["order_id"]]["status"] = "exchange requested"
            db["orders"][t["order_id"]]["exchanges"] = [{"item_id": t["item_id"], "new_item_id": t["new_item_id"]}]
        return db

    # ------------------------------------------------------------------ protocol
    def reset(self, seed: int) -> tuple[list[dict], list[dict]]:
        """Messages ``[system, user(instruction)]`` and the five tool schemas."""
        self.seed = int(seed)
        self._seed_latency(self.seed)
        self.db, self.task = self._generate(self.seed)
        self._initial_db = copy.deepcopy(self.db)
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": self.task["instruction"]}]
        return messages, [copy.deepcopy(t) for t in self.TOOLS]

    def _tools(self) -> dict[str, Any]:
        if not self.db:
            raise RuntimeError("call reset(seed) first")
        return {"get_user": self._get_user, "get_order": self._get_order, "get_product": self._get_product,
                "cancel_order": self._cancel_order, "exchange_item": self._exchange_item}

    def _order(self, order_id: Any) -> dict:
        oid = str(order_id).strip()
        if not oid.startswith("#"):
            oid = "#" + oid
        o = self.db["orders"].get(oid)
        if o is None:
            raise ToolError(f"order {order_id!r} not found")
        return o

    def _get_user(self, user_id: str) -> str:
        u = self.db["users"].get(str(user_id).strip())
        if u is None:
            raise ToolError(f"user {user_id!r} not found")
        return json.dumps(u)

    def _get_order(self, order_id: str) -> str:
        return json.dumps(self._order(order_id))

    def _get_product(self, product_id: str) -> str:
        p = self.db["products"].get(str(product_id).strip())
        if p is None:
            raise ToolError(f"product {product_id!r} not found")
        return json.dumps({"product_id": p["product_id"], "name": p["name"], "variants": list(p["variants"].values())})

    def _cancel_order(self, order_id: str, reason: str) -> str:
        o = self._order(order_id)
        if o["status"] != "pending":
            raise ToolError(f"order {o['order_id']} is {o['status']}; only pending orders can be cancelled")
        if reason not in CANCEL_REASONS:
            raise ToolError(f"reason must be one of {list(CANCEL_REASONS)}")
        o["status"] = "cancelled"
        o["cancel_reason"] = reason
        return json.dumps(o)

    def _exchange_item(self, order_id: str, item_id: str, new_item_id: str) -> str:
        o = self._order(order_id)
        if o["status"] != "delivered":
            raise ToolError(f"order {o['order_id']} is {o['status']}; only delivered orders can be exchanged")
        item = next((i for i in o["items"] if i["item_id"] == str(item_id)), None)
        if item is None:
            raise ToolError(f"item {item_id!r} is not in order {o['order_id']}")
        variants = self.db["products"][item["product_id"]]["variants"]
        new = variants.get(str(new_item_id))
        if new is None:
            raise ToolError(f"item {new_item_id!r} is not a variant of product {item['product_id']}")
        if new["item_id"] == item["item_id"]:
            raise ToolError("the new item must differ from the old one")
        if not new["available"]:
            raise ToolError(f"item {new_item_id} is not available")
        o["status"] = "exchange requested"
        o["exchanges"] = [{"item_id": item["item_id"], "new_item_id": new["item_id"]}]
        return json.dumps(o)

    @staticmethod
    def _answers_match(got: str, want: str) -> bool:
        g, w = got.strip().lower().lstrip("#").replace("$", "").replace(",", ""), want.strip().lower().lstrip("#")
        try:
            return abs(float(g) - float(w)) < 0.005
        except ValueError:
            return g == w

    def score(self, final_answer: str) -> tuple[float, dict]:
        """1.0 iff the database equals the expected final state and the answer matches."""
        if not self.task:
            raise RuntimeError("call reset(seed) first")
        ans, info = self._answer_or_reason(final_answer)
        db_match = self.db == self._expected_db()
        answer_match = ans is not None and self._answers_match(ans, self.task["answer"])
        info.update(kind=self.task["kind"], expected=self.task["answer"], db_match=db_match, answer_match=answer_match)
        return (1.0 if (db_match and answer_match) else 0.0), info

    def reference_solution(self, seed: int) -> list[dict]:
        """A correct tool-use path for the task, played through :meth:`step`."""
        self.reset(seed)
        t = self.task
        msgs: list[dict] = []

        def turn(*calls: dict) -> list[str]:
            msgs.append({"role": "assistant", "content": "", "tool_calls": list(calls)})
            obs = [self.step(c) for c in calls]
            msgs.extend({"role": "tool", "content": o} for o in obs)
            return obs

        if t["kind"] == "cancel":
            turn({"name": "get_order", "arguments": {"order_id": t["order_id"]}})
            turn({"name": "cancel_order", "arguments": {"order_id": t["order_id"], "reason": "no longer needed"}})
        elif t["kind"] == "exchange":
            turn({"name": "get_order", "arguments": {"order_id": t["order_id"]}})
            turn({"name": "get_product", "arguments": {"product_id": t["product_id"]}})
            turn({"name": "exchange_item", "arguments": {"order_id": t["order_id"], "item_id": t["item_id"],
                                                         "new_item_id": t["new_item_id"]}})
        else:
            (u,) = turn({"name": "get_user", "arguments": {"user_id": t["user_id"]}})
            turn(*({"name": "get_order", "arguments": {"order_id": o}} for o in json.loads(u)["orders"]))
        msgs.append({"role": "assistant", "content": f"<answer>{t['answer']}</answer>"})
        return msgs


def check_config(env_cfg: Any) -> None:
    """``env.retail`` (``jax_rl.config.EnvConfig``) checked at the start of a run: each knob is one
    :class:`RetailEnv` takes (the tool latency aside: ``rollout.tool_latency_s``).

    Raises:
        ValueError: an unknown knob, with the closest known one and the known ones.
    """
    import difflib
    import inspect

    known = {n for c in (RetailEnv, BaseEnv) for n, prm in inspect.signature(c.__init__).parameters.items()
             if n != "self" and prm.kind is prm.POSITIONAL_OR_KEYWORD} - {"tool_latency_s", "tool_latency_dist"}
    for k in env_cfg.retail:
        if k not in known:
            m = difflib.get_close_matches(k, list(known), n=1, cutoff=0.6)
            hint = f"; did you mean 'env.retail.{m[0]}'?" if m else ""
            raise ValueError(f"unknown config key 'env.retail.{k}'{hint} (env.retail takes {sorted(known)})")


SPEC = EnvSpec(make=RetailEnv, section="retail", kwargs=lambda env_cfg: dict(env_cfg.retail),
               check_knobs=check_retail_knobs, check=check_config)
"""``env.name=retail`` in :data:`rollout.envs.ENVS`."""
