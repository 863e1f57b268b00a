#include "engine/output_text.h"

#include <algorithm>

#include "core/utf8.h"

namespace ferry::engine {

namespace {

// Moves the complete UTF-8 characters at the front of `pending` to `out`; an incomplete
// character at the end stays unless `flush`. Bytes that can never form a character become
// U+FFFD.
void TakeCompleteUtf8(std::string* pending, std::string* out, bool flush) {
    size_t i = 0;
    const std::string& p = *pending;
    while (i < p.size()) {
        auto c = static_cast<unsigned char>(p[i]);
        size_t n = Utf8SequenceLength(c);
        if (n == 0) {
            out->append("\xef\xbf\xbd");
            ++i;
            continue;
        }
        size_t k = 1;
        while (k < n && i + k < p.size() && (static_cast<unsigned char>(p[i + k]) & 0xc0) == 0x80) {
            ++k;
        }
        if (k == n) {
            out->append(p, i, n);
            i += n;
        } else if (i + k == p.size() && !flush) {
            break;  // wait for the rest of the character
        } else {
            out->append("\xef\xbf\xbd");
            i += k;
        }
    }
    pending->erase(0, i);
}

}  // namespace

OutputText::OutputText(std::vector<std::string> stops) : stops_(std::move(stops)) {
    for (const std::string& s : stops_) max_stop_ = std::max(max_stop_, s.size());
}

bool OutputText::Append(std::string_view token_bytes) {
    pending_.append(token_bytes);
    TakeCompleteUtf8(&pending_, &held_, false);
    for (const std::string& stop : stops_) {
        const size_t at = held_.find(stop);
        if (at != std::string::npos) {
            held_.resize(at);
            pending_.clear();
            return true;
        }
    }
    return false;
}

std::string OutputText::TakeReady() {
    const size_t keep = max_stop_ > 0 ? max_stop_ - 1 : 0;
    if (held_.size() <= keep) return {};
    size_t cut = held_.size() - keep;
    while (cut > 0 && (static_cast<unsigned char>(held_[cut]) & 0xc0) == 0x80 &&
           cut < held_.size()) {
        --cut;
    }
    std::string ready = held_.substr(0, cut);
    held_.erase(0, cut);
    return ready;
}

std::string OutputText::TakeRest() {
    TakeCompleteUtf8(&pending_, &held_, true);
    std::string rest = std::move(held_);
    held_.clear();
    return rest;
}

}  // namespace ferry::engine
