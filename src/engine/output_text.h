// The text of one request's output as it streams: token bytes assembled into whole UTF-8
// characters, stop strings found across token boundaries (the text ends before the first one),
// and what could still be the start of a stop string held back until it cannot.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace ferry::engine {

class OutputText {
  public:
    explicit OutputText(std::vector<std::string> stops);

    // Appends one token's bytes. True when a stop string completed: the text then ends before
    // it, and TakeRest gives what is left of it.
    bool Append(std::string_view token_bytes);
    // What may be sent now: all but what could still begin a stop string, in whole characters.
    std::string TakeReady();
    // Everything not yet taken, at the request's end (an incomplete character becomes U+FFFD).
    std::string TakeRest();

  private:
    std::vector<std::string> stops_;
    size_t max_stop_ = 0;
    std::string pending_;  // an incomplete UTF-8 character
    std::string held_;     // text held back while a stop string may be forming
};

}  // namespace ferry::engine
