#include "kv/kv_layout.h"

#include <fmt/core.h>

#include <algorithm>

namespace ferry::kv {

namespace {

// Folds a stream of (local offset, remote offset, length) runs into strided span pairs: runs that
// continue each other on both sides grow the current span; runs of its length at one constant
// step on both sides become its repetitions.
class SpanFolder {
  public:
    explicit SpanFolder(KvPlan* plan) : plan_(plan) {}

    void Add(uint64_t l, uint64_t r, uint64_t len) {
        plan_->bytes += len;
        if (open_) {
            if (local_.count == 1 && l == local_.offset + local_.length &&
                r == remote_.offset + remote_.length) {
                local_.length += len;
                remote_.length += len;
                return;
            }
            if (len == local_.length && l > local_.offset && r > remote_.offset) {
                if (local_.count == 1) {
                    uint64_t ls = l - local_.offset, rs = r - remote_.offset;
                    if (ls >= len && rs >= len) {
                        local_.stride = ls;
                        remote_.stride = rs;
                        local_.count = remote_.count = 2;
                        return;
                    }
                } else if (l == local_.offset + local_.count * local_.stride &&
                           r == remote_.offset + remote_.count * remote_.stride) {
                    ++local_.count;
                    ++remote_.count;
                    return;
                }
            }
            Flush();
        }
        local_ = {l, len, 0, 1};
        remote_ = {r, len, 0, 1};
        open_ = true;
    }

    // Ends the current span; call once after the last Add.
    void Flush() {
        if (!open_) return;
        plan_->local.push_back(local_);
        plan_->remote.push_back(remote_);
        open_ = false;
    }

  private:
    KvPlan* plan_;
    bool open_ = false;
    KvSpan local_, remote_;
};

Status CheckTable(std::span<const BlockId> table, int blocks_needed, int num_blocks,
                  const char* side) {
    if (static_cast<int>(table.size()) < blocks_needed) {
        return InvalidArgumentError(
            fmt::format("kv plan: the {} block table has {} blocks, the "
                        "token range needs {}",
                        side, table.size(), blocks_needed));
    }
    for (int i = 0; i < blocks_needed; ++i) {
        if (table[i] < 0 || table[i] >= num_blocks) {
            return InvalidArgumentError(
                fmt::format("kv plan: {} block id {} is outside its cache of {} blocks", side,
                            table[i], num_blocks));
        }
    }
    return Status::Ok();
}

// K and V, or the one latent tensor (whose V is its K).
std::span<const bool> Planes(const KvCacheSpec& s) {
    static constexpr bool kBoth[] = {false, true};
    return {kBoth, static_cast<size_t>(s.Planes())};
}

struct Range {
    int l0, l1, h0, h1;
};

// The layers and heads `m` moves, checked against both layouts.
Result<Range> MoveRange(const KvLayout& local, const KvLayout& remote, const KvMove& m) {
    const KvCacheSpec& ls = local.spec;
    const KvCacheSpec& rs = remote.spec;
    Range r;
    r.l0 = m.layer_begin;
    r.l1 = m.layer_end < 0 ? ls.num_layers : m.layer_end;
    if (r.l0 < 0 || r.l0 > r.l1 || r.l1 > ls.num_layers) {
        return InvalidArgumentError(
            fmt::format("kv plan: layers [{}, {}) outside 0..{}", r.l0, r.l1, ls.num_layers));
    }
    const int h_lo = std::max(local.head_begin, remote.head_begin);
    const int h_hi = std::min(local.head_begin + ls.kv_heads, remote.head_begin + rs.kv_heads);
    r.h0 = m.head_end < 0 ? h_lo : m.head_begin;
    r.h1 = m.head_end < 0 ? h_hi : m.head_end;
    if (r.h0 >= r.h1 || r.h0 < h_lo || r.h1 > h_hi) {
        return InvalidArgumentError(fmt::format(
            "kv plan: kv heads [{}, {}) are not held by both sides (local [{}, {}), remote "
            "[{}, {}))",
            r.h0, r.h1, local.head_begin, local.head_begin + ls.kv_heads, remote.head_begin,
            remote.head_begin + rs.kv_heads));
    }
    if (m.token_begin < 0 || m.token_begin > m.token_end) {
        return InvalidArgumentError(
            fmt::format("kv plan: token range [{}, {})", m.token_begin, m.token_end));
    }
    return r;
}

// Different block sizes on the two sides (any two sizes): the token range is cut where either
// side's block ends, so each piece is contiguous in one block of each side; a piece's rows for
// one head are one run. Per piece, one strided span over the heads (stride: each side's head
// size) per layer and K|V, or one over the layers and K|V (stride: each side's tensor) per head,
// whichever makes fewer.
Result<KvPlan> PlanAcrossBlockSizes(const KvLayout& local, const KvLayout& remote,
                                    const KvMove& m) {
    FERRY_ASSIGN_OR_RETURN(Range g, MoveRange(local, remote, m));
    KvPlan plan;
    if (m.token_begin == m.token_end || g.l0 == g.l1) return plan;
    const int lb = local.spec.block_tokens, rb = remote.spec.block_tokens;
    FERRY_RETURN_IF_ERROR(
        CheckTable(m.local_blocks, (m.token_end + lb - 1) / lb, local.spec.num_blocks, "local"));
    FERRY_RETURN_IF_ERROR(
        CheckTable(m.remote_blocks, (m.token_end + rb - 1) / rb, remote.spec.num_blocks, "remote"));
    const int lh = g.h0 - local.head_begin, rh = g.h0 - remote.head_begin;
    const int nh = g.h1 - g.h0, nlv = local.spec.Planes() * (g.l1 - g.l0);
    const uint64_t row = local.RowBytes();
    SpanFolder fold(&plan);
    for (int t = m.token_begin; t < m.token_end;) {
        const int e = std::min({(t / lb + 1) * lb, (t / rb + 1) * rb, m.token_end});
        const BlockId lblock = m.local_blocks[t / lb], rblock = m.remote_blocks[t / rb];
        const int lslot = t % lb, rslot = t % rb;
        const uint64_t len = uint64_t(e - t) * row;
        auto add = [&](int l, bool v, int h) {
            fold.Add(local.Offset(l, v, lblock, lh + h, lslot),
                     remote.Offset(l, v, rblock, rh + h, rslot), len);
        };
        if (nh <= nlv) {
            for (int h = 0; h < nh; ++h) {
                for (int l = g.l0; l < g.l1; ++l) {
                    for (bool v : Planes(local.spec)) add(l, v, h);
                }
                fold.Flush();
            }
        } else {
            for (int l = g.l0; l < g.l1; ++l) {
                for (bool v : Planes(local.spec)) {
                    for (int h = 0; h < nh; ++h) add(l, v, h);
                    fold.Flush();
                }
            }
        }
        t = e;
    }
    fold.Flush();
    return plan;
}

}  // namespace

Result<KvPlan> PlanKvMove(const KvLayout& local, const KvLayout& remote, const KvMove& m) {
    const KvCacheSpec& ls = local.spec;
    const KvCacheSpec& rs = remote.spec;
    auto differ = [](const char* what, auto a, auto b) {
        return InvalidArgumentError(
            fmt::format("kv plan: {} differs (local {}, remote {})", what, a, b));
    };
    if (ls.num_layers != rs.num_layers) return differ("layers", ls.num_layers, rs.num_layers);
    if (ls.latent != rs.latent) {
        return differ("attention", ls.latent ? "mla" : "gqa", rs.latent ? "mla" : "gqa");
    }
    if (ls.head_dim != rs.head_dim) return differ("head dim", ls.head_dim, rs.head_dim);
    if (ls.dtype != rs.dtype) return differ("dtype", KvDtypeName(ls.dtype), KvDtypeName(rs.dtype));
    if (ls.block_tokens < 1 || rs.block_tokens < 1) {
        return differ("block size", ls.block_tokens, rs.block_tokens);
    }
    if (ls.block_tokens != rs.block_tokens) return PlanAcrossBlockSizes(local, remote, m);

    const int bt = ls.block_tokens;
    FERRY_ASSIGN_OR_RETURN(Range g, MoveRange(local, remote, m));
    const int l0 = g.l0, l1 = g.l1, h0 = g.h0, h1 = g.h1;
    KvPlan plan;
    if (m.token_begin == m.token_end || l0 == l1) return plan;
    const int b0 = m.token_begin / bt, b1 = (m.token_end + bt - 1) / bt;
    FERRY_RETURN_IF_ERROR(CheckTable(m.local_blocks, b1, ls.num_blocks, "local"));
    FERRY_RETURN_IF_ERROR(CheckTable(m.remote_blocks, b1, rs.num_blocks, "remote"));

    const int nh = h1 - h0;
    const int lh = h0 - local.head_begin, rh = h0 - remote.head_begin;
    // Whole blocks are contiguous on both sides only when each side moves all the heads it holds.
    const bool whole_heads = nh == ls.kv_heads && nh == rs.kv_heads;
    const uint64_t row = local.RowBytes();
    SpanFolder fold(&plan);

    int i = b0;
    while (i < b1) {
        const int s0 = i == b0 ? m.token_begin - i * bt : 0;
        const int s1 = std::min(bt, m.token_end - i * bt);
        if (s0 != 0 || s1 != bt) {
            // A partial block: the slots of each head, one run per head.
            for (int l = l0; l < l1; ++l) {
                for (bool v : Planes(local.spec)) {
                    for (int h = 0; h < nh; ++h) {
                        fold.Add(local.Offset(l, v, m.local_blocks[i], lh + h, s0),
                                 remote.Offset(l, v, m.remote_blocks[i], rh + h, s0),
                                 uint64_t(s1 - s0) * row);
                    }
                }
            }
            ++i;
            continue;
        }
        // A run of whole blocks whose ids are adjacent on both sides.
        int j = i + 1;
        while (j < b1 && std::min(bt, m.token_end - j * bt) == bt &&
               m.local_blocks[j] == m.local_blocks[j - 1] + 1 &&
               m.remote_blocks[j] == m.remote_blocks[j - 1] + 1) {
            ++j;
        }
        const int n = j - i;
        for (int l = l0; l < l1; ++l) {
            for (bool v : Planes(local.spec)) {
                if (whole_heads) {
                    fold.Add(local.Offset(l, v, m.local_blocks[i], 0, 0),
                             remote.Offset(l, v, m.remote_blocks[i], 0, 0),
                             uint64_t(n) * ls.BlockBytes());
                    continue;
                }
                for (int k = i; k < j; ++k) {
                    fold.Add(local.Offset(l, v, m.local_blocks[k], lh, 0),
                             remote.Offset(l, v, m.remote_blocks[k], rh, 0),
                             uint64_t(nh) * ls.HeadBytes());
                }
            }
        }
        i = j;
    }
    fold.Flush();
    return plan;
}

}  // namespace ferry::kv
