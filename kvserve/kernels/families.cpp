// The registry behind KVSERVE_KERNEL_FAMILY (kernels.h): each family's source registers
// itself at load, so a level's build lists exactly the families it compiled code for.
#include "kernels.h"

namespace {
std::vector<std::pair<std::string, std::string>>& registry() {
  static std::vector<std::pair<std::string, std::string>> families;  // built on first use: no init-order trap
  return families;
}
}  // namespace

FamilyRegistration::FamilyRegistration(const char* family, const char* level) { registry().emplace_back(family, level); }

std::vector<std::pair<std::string, std::string>> kernel_families() { return registry(); }
