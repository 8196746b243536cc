"""Mutations of the token and user rules (issues 18 and 19): who a caller is, what they
may see and do, and that a refused peer learns it at once."""

from __future__ import annotations

from mutation_table import Mutation

U = "tests/unit/test_users.py"

USERS: tuple[Mutation, ...] = (
    Mutation(
        "users-ownership-open", "scheduler/books/users.py",
        "    return viewer is not None and (viewer.admin or viewer.user == owner)\n",
        "    return viewer is not None\n",
        (f"{U}::test_another_users_call_behaves_like_an_unknown_one",),
        "any user may attach to and cancel another user's call",
    ),
    Mutation(
        "users-status-rows-unfiltered", "scheduler/desks/user_desk.py",
        '                d["running"] = [r for r in d["running"] if r.get("user") == viewer.user]\n',
        "                pass\n",
        (f"{U}::test_status_logs_and_usage_show_a_user_their_own",),
        "gpufn status shows every user's call rows",
    ),
    Mutation(
        "users-logs-unfiltered", "scheduler/books/logs.py",
        "                if user is not None and line.user != user:\n                    continue\n",
        "",
        (f"{U}::test_status_logs_and_usage_show_a_user_their_own",),
        "gpufn logs shows every user's output",
    ),
    Mutation(
        "users-usage-unfiltered", "scheduler/books/usage.py",
        "                if user is not None and k.user != user:\n                    continue\n",
        "",
        (f"{U}::test_status_logs_and_usage_show_a_user_their_own",),
        "gpufn usage counts every user's calls for anyone",
    ),
    Mutation(
        "users-claimed-identity", "scheduler/core.py",
        "        inv.user = self.peers[peer].user  # from its token, never the client's claim\n",
        "        inv.user = self.peers[peer].info.user\n",
        (f"{U}::test_the_token_decides_the_user_never_the_client",),
        "a call's user is what the client claims, not its token's",
    ),
    Mutation(
        "users-worker-with-user-token", "scheduler/peers/handshake.py",
        "    if msg.role != p.Role.CLIENT and not who.admin:  # a worker sees every user's calls\n",
        "    if False:\n",
        (f"{U}::test_the_token_decides_the_user_never_the_client",),
        "a user's token admits a worker host (which sees every call)",
    ),
    Mutation(
        "users-operations-open", "scheduler/desks/user_desk.py",
        "        if may_operate(peer, self.store):\n            return None\n",
        "        return None\n",
        (f"{U}::test_operations_need_the_admin_or_an_operator",),
        "any user may deploy, roll back, stop apps and shut down",
    ),
    Mutation(
        "users-revoke-keeps-connections", "scheduler/desks/user_desk.py",
        '            self._drop(k, now, f"its token {why}")\n',
        "            pass\n",
        (f"{U}::test_a_revoked_token_is_refused_at_once_connected_or_not",),
        "a revoked user's open connections keep working",
    ),
    Mutation(
        "users-no-priority-ceiling", "scheduler/books/users.py",
        "    return replace(spec, priority=user.max_priority)\n",
        "    return spec\n",
        (f"{U}::test_a_call_over_the_priority_ceiling_runs_at_the_ceiling",),
        "a call over its user's priority ceiling runs at the priority it asked for",
    ),
    Mutation(
        "users-device-cap-ignored", "scheduler/placement/placement_pass.py",
        "            if capped and self.caps is not None and not self.caps.admits(inv):\n",
        "            if False:\n",
        (f"{U}::test_calls_over_the_device_cap_wait_aside_without_blocking_others",
         "tests/integration/test_users.py::test_calls_over_the_device_cap_wait_their_turn_and_say_why"),
        "calls run over their user's device cap",
    ),
    Mutation(
        "users-device-cap-blocks-others", "scheduler/placement/placement_pass.py",
        "                self.queue.hold(inv)  # its user is at their device cap: it waits aside\n",
        "                pass\n",
        (f"{U}::test_calls_over_the_device_cap_wait_aside_without_blocking_others",),
        "a call waiting at its user's cap blocks other users' calls of the same function",
    ),
    Mutation(
        "users-cap-never-released", "scheduler/placement/placement_pass.py",
        "            self.queue.unhold(user, self.caps.room(user))\n",
        "            pass\n",
        (f"{U}::test_raising_the_cap_lets_waiting_calls_go_at_once",),
        "calls set aside at a cap never get their turn",
    ),
    Mutation(
        "client-drops-refused-welcome", "gpufn/client/client.py",
        "            if not msg.ok:\n                self._refused(msg)\n",
        "            if not msg.ok:\n                pass\n",
        ("tests/unit/test_connection.py::test_a_refused_rehello_fails_every_pending_call_at_once",
         "tests/integration/test_users.py::test_a_revoked_token_fails_at_once"),
        "a refused re-hello is dropped and the client's pending calls hang",
    ),
    Mutation(
        "serve-new-token-every-start", "gpufn/net/cluster_file.py",
        "    if not token and not rotate:\n",
        "    if False:\n",
        ("tests/integration/test_users.py::"
         "test_serve_keeps_its_token_and_a_refused_reconnect_fails_calls_at_once",),
        "gpufn serve makes a new token on every start",
    ),
    Mutation(
        "from-id-cancel-always-true", "gpufn/api/calls.py",
        '            return self._client.cancel_checked(self._id, "cancelled by the caller")\n',
        '            self._client.cancel(self._id, "cancelled by the caller")\n            return True\n',
        ("tests/integration/test_users.py::test_two_users_read_only_their_own_and_the_admin_reads_all",),
        "cancel() of another user's call returns True",
    ),
)
